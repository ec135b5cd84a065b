"""Where a process finds its credentials: the names the runtime reads and the operator
mounts, kept here (no ZMQ, no crypto) so that both use the same ones.

- Stage keys (``omni_runtime.stage_keys``): a directory, named by ``OMNI_STAGE_KEYS_DIR``,
  of Z85 CURVE keys in files named as the operator's stage-keys Secret names its data. A
  stage server reads ``SERVER_FILES``, a router ``CLIENT_FILES``; neither gets the other's
  secret.
- API keys (``omni_runtime.router.auth``): a file of keys, one per line, named by
  ``--api-key-file`` or ``OMNI_API_KEY_FILE``; or one key in ``OMNI_API_KEY``.
"""

from __future__ import annotations

KEYS_DIR_ENV = "OMNI_STAGE_KEYS_DIR"
SERVER_SECRET = "server.key"
SERVER_PUBLIC = "server.pub"
CLIENT_SECRET = "client.key"
CLIENT_PUBLIC = "client.pub"
KEY_FILES = (SERVER_SECRET, SERVER_PUBLIC, CLIENT_SECRET, CLIENT_PUBLIC)
SERVER_FILES = (SERVER_SECRET, SERVER_PUBLIC, CLIENT_PUBLIC)
CLIENT_FILES = (CLIENT_SECRET, CLIENT_PUBLIC, SERVER_PUBLIC)

API_KEY_ENV = "OMNI_API_KEY"
API_KEY_FILE_ENV = "OMNI_API_KEY_FILE"
