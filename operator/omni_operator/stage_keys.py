"""The pipeline's stage keys, made by the operator: two CURVE key pairs (Curve25519, as
libzmq's CURVE uses them), Z85 text, named as the runtime reads them
(``omni_runtime.config.credentials``).

The operator image has no libzmq, so the pairs come from the ``cryptography`` package's
X25519, which is the same function: a secret is 32 random bytes and its public key the
(clamped) secret times the curve's base point, as libsodium's ``crypto_box_keypair``
computes it. The keys live only in the Secret the reconciler creates; never in the
ConfigMap, an environment value, a log line or an Event.
"""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from omni_runtime.config.credentials import (
    CLIENT_PUBLIC,
    CLIENT_SECRET,
    SERVER_PUBLIC,
    SERVER_SECRET,
)

# ZeroMQ's Z85 alphabet (RFC 32/Z85): 85 printable characters, none needing quotes.
_Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"


def z85_encode(data: bytes) -> str:
    """``data`` (a multiple of 4 bytes) as Z85: each 4 bytes, big-endian, as 5 digits."""
    if len(data) % 4:
        raise ValueError(f"Z85 encodes multiples of 4 bytes, not {len(data)}")
    out: list[str] = []
    for start in range(0, len(data), 4):
        value = int.from_bytes(data[start : start + 4], "big")
        digits = []
        for _ in range(5):
            value, digit = divmod(value, 85)
            digits.append(_Z85[digit])
        out.extend(reversed(digits))
    return "".join(out)


def _key_pair() -> tuple[str, str]:
    """(public, secret), Z85."""
    secret = X25519PrivateKey.generate()
    secret_bytes = secret.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    public_bytes = secret.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return z85_encode(public_bytes), z85_encode(secret_bytes)


def generate_stage_keys() -> dict[str, str]:
    """A new pipeline's keys, by file name: the stage servers' pair and the routers'."""
    server_public, server_secret = _key_pair()
    client_public, client_secret = _key_pair()
    return {
        SERVER_SECRET: server_secret,
        SERVER_PUBLIC: server_public,
        CLIENT_SECRET: client_secret,
        CLIENT_PUBLIC: client_public,
    }
