"""A kubeconfig ``exec`` credential plugin for the cluster tests, as ``aws eks get-token``
or ``gke-gcloud-auth-plugin`` are in real clusters.

    exec_credential_plugin.py TOKEN_FILE CALLS_FILE

Prints an ExecCredential (client.authentication.k8s.io/v1) carrying the token in
TOKEN_FILE, valid for an hour, and appends the ExecCredential request the client gave it
($KUBERNETES_EXEC_INFO) as one JSON line to CALLS_FILE, so that a test can tell that, and
how, it ran. Standard library only.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

API_VERSION = "client.authentication.k8s.io/v1"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: exec_credential_plugin.py TOKEN_FILE CALLS_FILE", file=sys.stderr)
        return 2
    token_file, calls = Path(argv[0]), Path(argv[1])
    request = os.environ.get("KUBERNETES_EXEC_INFO", "")
    with calls.open("a") as out:
        out.write(json.dumps(json.loads(request) if request else None) + "\n")
    try:
        token = token_file.read_text().strip()
    except OSError as e:
        # As a real plugin fails (no SSO session, say): a message and a non-zero exit.
        print(f"cannot read {token_file}: {e.strerror}", file=sys.stderr)
        return 1
    expiry = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
    credential = {
        "apiVersion": API_VERSION,
        "kind": "ExecCredential",
        "status": {
            "token": token,
            "expirationTimestamp": expiry.strftime("%Y-%m-%dT%H:%M:%SZ"),
        },
    }
    print(json.dumps(credential))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
