"""ed25519 signatures of ``model.yaml`` with ``cryptography`` (the models extra): a key pair, a signature, a check.

``model.yaml.sig`` holds the base64 of the 64-byte signature of ``model.yaml``'s bytes, exactly as they are on
disk. The manifest lists the sha256 of every weight file, so a valid signature vouches for the weights too. Keys
are PEM files: the private key PKCS#8 (unencrypted: keep it off the serving machines), the public key
SubjectPublicKeyInfo, as ``openssl genpkey -algorithm ed25519`` writes them.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import Any

from fleet.errors import ConfigError

MAX_SIGNATURE_BYTES = 1024


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ModuleNotFoundError:
        raise ConfigError(
            "signed model manifests need the 'cryptography' package: pip install 'fleet-inference[models]'"
        ) from None
    return serialization, ed25519


def generate_key_pair() -> tuple[bytes, bytes]:
    """``(private PEM, public PEM)`` of a new ed25519 key."""
    serialization, ed25519 = _crypto()
    key = ed25519.Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return private, public


def sign(data: bytes, private_pem: bytes, where: str = "private key") -> bytes:
    """The base64 text (with a newline) of ``data``'s signature, as ``model.yaml.sig`` holds it."""
    serialization, ed25519 = _crypto()
    try:
        key = serialization.load_pem_private_key(private_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{where}: not an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise ConfigError(f"{where}: an ed25519 key is needed, not {type(key).__name__}")
    return base64.b64encode(key.sign(data)) + b"\n"


def public_key(public_pem: bytes, where: str = "model_public_key") -> Any:
    serialization, ed25519 = _crypto()
    try:
        key = serialization.load_pem_public_key(public_pem)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{where}: not a PEM public key ({exc})") from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise ConfigError(f"{where}: an ed25519 public key is needed, not {type(key).__name__}")
    return key


def check_signature(manifest: Path, data: bytes, signature: Path, public_pem: bytes) -> None:
    """Raise ``ConfigError`` unless ``signature`` holds a valid signature of ``data`` (``manifest``'s bytes).

    Raises:
        ConfigError: the signature file is missing, unreadable, not base64, or not a valid signature.
    """
    from cryptography.exceptions import InvalidSignature

    key = public_key(public_pem)
    if not signature.is_file():
        raise ConfigError(
            f"{manifest}: no {signature.name}, and FLEET_MODEL_PUBLIC_KEY requires every model to be signed "
            "(fleet models sign NAME@VERSION --private-key PEM)"
        )
    try:
        with signature.open("rb") as f:
            text = f.read(MAX_SIGNATURE_BYTES + 1)
        if len(text) > MAX_SIGNATURE_BYTES:
            raise ConfigError(f"{signature}: over {MAX_SIGNATURE_BYTES} bytes, not a signature")
        raw = base64.b64decode(text.strip(), validate=True)
    except OSError as exc:
        raise ConfigError(f"{signature}: {exc.strerror or exc}") from None
    except binascii.Error:
        raise ConfigError(f"{signature}: not base64 text") from None
    try:
        key.verify(raw, data)
    except InvalidSignature:
        raise ConfigError(
            f"{signature}: not a valid signature of {manifest.name} by the key FLEET_MODEL_PUBLIC_KEY names "
            "(the manifest changed after it was signed, or another key signed it)"
        ) from None
