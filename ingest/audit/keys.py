"""Where audit data keys come from: one static key, a local keyring file, or AWS KMS.

Envelope encryption: each trail asks its ``KeySource`` for a fresh 256-bit data
key, seals records under it with AES-256-GCM, and writes the data key's
encrypted form (``edk``, as the key service returned it) into every envelope,
so a holder of the key-encryption key can decrypt any record, however old,
while the worker never holds more than its current data key. The encryption
context names the worker and the trail (``context``); KMS binds it to the
``edk`` and checks it on ``Decrypt``, and the keyring authenticates it as AES-GCM
associated data, so a data key cannot be moved to another trail.

- ``StaticKey``: ``DICOM_INGEST_AUDIT_KEY``, one key used directly (``kid`` names
  it, and envelopes carry no ``edk``); it cannot rotate. For development and the demo.
- ``LocalKeyring``: a JSON file ``{"v": 1, "current": NAME, "keys": {NAME: B64}}``
  of 32-byte key-encryption keys, readable by its owner only. Rotating the
  keyring is adding a key and pointing ``current`` at it; old keys stay to
  unwrap old records. For the embedded stack: no AWS needed.
- ``KmsKeys``: ``GenerateDataKey`` (AES_256) and ``Decrypt`` with the context,
  on an aiobotocore client (standard credential chain, optional endpoint).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import stat
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ingest.errors import ConfigError, KeyRefused, KeyServiceError

KEY_BYTES = 32
_NONCE = 12


@dataclass(frozen=True, slots=True)
class DataKey:
    """One data key: ``kid`` names the key (or key-encryption key), ``edk`` wraps it."""

    kid: str
    key: bytes = field(repr=False)
    edk: bytes | None
    created: float = field(default_factory=time.monotonic)


def context(worker: str, trail: str) -> dict[str, str]:
    """The encryption context of a trail's data keys (KMS wants string to string)."""
    return {"dicom-ingest:worker": worker, "dicom-ingest:trail": trail}


class KeySource(Protocol):
    async def new_data_key(self, ctx: Mapping[str, str]) -> DataKey: ...

    async def unwrap(self, kid: str, edk: bytes, ctx: Mapping[str, str]) -> bytes: ...

    async def aclose(self) -> None: ...


class StaticKey:
    """One key, used as it is: every "new" data key is the same key, with no ``edk``."""

    def __init__(self, key: bytes, kid: str) -> None:
        if len(key) != KEY_BYTES:
            raise ConfigError(f"audit key must be {KEY_BYTES} bytes")
        self._key, self._kid = key, kid

    async def new_data_key(self, ctx: Mapping[str, str]) -> DataKey:
        return DataKey(self._kid, self._key, None)

    async def unwrap(self, kid: str, edk: bytes, ctx: Mapping[str, str]) -> bytes:
        raise KeyRefused("a static audit key wraps no data keys")

    async def aclose(self) -> None:
        return None


def _keyring_aad(name: str, ctx: Mapping[str, str]) -> bytes:
    return json.dumps({"kek": name, **ctx}, sort_keys=True, separators=(",", ":")).encode()


class LocalKeyring:
    """Key-encryption keys from a file; data keys are wrapped with AES-256-GCM."""

    def __init__(self, path: Path) -> None:
        self._keks, self._current = read_keyring(path)

    async def new_data_key(self, ctx: Mapping[str, str]) -> DataKey:
        key, nonce = os.urandom(KEY_BYTES), os.urandom(_NONCE)
        kek = self._keks[self._current]
        edk = nonce + AESGCM(kek).encrypt(nonce, key, _keyring_aad(self._current, ctx))
        return DataKey(f"keyring:{self._current}", key, edk)

    async def unwrap(self, kid: str, edk: bytes, ctx: Mapping[str, str]) -> bytes:
        name = kid.removeprefix("keyring:")
        if not kid.startswith("keyring:") or name not in self._keks:
            raise KeyRefused(f"no keyring key {kid!r}")
        try:
            return AESGCM(self._keks[name]).decrypt(
                edk[:_NONCE], edk[_NONCE:], _keyring_aad(name, ctx)
            )
        except (InvalidTag, ValueError):
            raise KeyRefused(f"data key does not unwrap under {kid!r} in this context") from None

    async def aclose(self) -> None:
        return None


def read_keyring(path: Path) -> tuple[dict[str, bytes], str]:
    """The keys and the current key's name of a keyring file.

    Raises:
        ConfigError: unreadable, readable by others than its owner, or malformed.
    """
    where = f"audit keyring {path}"
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{where}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{where}: readable by others; chmod 600 it")
    try:
        data = json.loads(text)
        keys = {str(n): base64.b64decode(v, validate=True) for n, v in data["keys"].items()}
        current = str(data["current"])
    except (ValueError, KeyError, TypeError, AttributeError, binascii.Error):
        raise ConfigError(
            f"{where}: expected {{'v': 1, 'current': NAME, 'keys': {{NAME: B64}}}}"
        ) from None
    if current not in keys or any(len(k) != KEY_BYTES for k in keys.values()):
        raise ConfigError(f"{where}: 'current' must name one of its 32-byte keys")
    return keys, current


def write_keyring(path: Path, rotate: bool = False) -> str:
    """Create a keyring file (mode 600), or with ``rotate`` add a key and make it current.

    Returns the new key's name.

    Raises:
        ConfigError: the file exists (without ``rotate``) or is not a keyring.
    """
    keys, n = ({}, 1) if not rotate else (read_keyring(path)[0], 0)
    if not rotate and path.exists():
        raise ConfigError(f"audit keyring {path}: exists already (rotate it instead)")
    n = max(n, len(keys) + 1)
    name = f"kek-{n}"
    keys[name] = os.urandom(KEY_BYTES)
    body = {
        "v": 1,
        "current": name,
        "keys": {k: base64.b64encode(v).decode() for k, v in keys.items()},
    }
    # a private temporary file of a fresh name (mkstemp: O_EXCL, mode 600), never a fixed
    # name that someone could have created, or pointed elsewhere with a symlink, before us
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(body, out, indent=1)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return name


class KmsClient:
    """One aiobotocore KMS client, opened on first use (standard credential chain)."""

    def __init__(self, endpoint_url: str | None, ca_bundle: str | None = None) -> None:
        self._endpoint = endpoint_url
        self._verify = ca_bundle
        self._client: Any = None
        self._exit: Any = None

    async def client(self) -> Any:
        if self._client is None:
            from aiobotocore.config import AioConfig
            from aiobotocore.session import get_session

            config = AioConfig(connect_timeout=10, read_timeout=30, retries={"max_attempts": 3})
            creator = get_session().create_client(
                "kms", endpoint_url=self._endpoint, config=config, verify=self._verify
            )
            self._client = await creator.__aenter__()
            self._exit = creator.__aexit__
        return self._client

    async def aclose(self) -> None:
        if self._exit is not None:
            exit_, self._exit, self._client = self._exit, None, None
            await exit_(None, None, None)


class KmsKeys:
    """Data keys from AWS KMS. ``key_id`` is needed to make keys, not to unwrap them."""

    def __init__(
        self, key_id: str | None, endpoint_url: str | None, ca_bundle: str | None = None
    ) -> None:
        self._key_id = key_id
        self._kms = KmsClient(endpoint_url, ca_bundle)

    async def new_data_key(self, ctx: Mapping[str, str]) -> DataKey:
        if not self._key_id:
            raise ConfigError("DICOM_INGEST_AUDIT_KMS_KEY_ID: needed to make data keys")
        kms = await self._kms.client()
        try:
            answer = await kms.generate_data_key(
                KeyId=self._key_id, KeySpec="AES_256", EncryptionContext=dict(ctx)
            )
        except Exception as exc:
            raise translate_kms_error(exc, "GenerateDataKey") from exc
        return DataKey(
            str(answer["KeyId"]), bytes(answer["Plaintext"]), bytes(answer["CiphertextBlob"])
        )

    async def unwrap(self, kid: str, edk: bytes, ctx: Mapping[str, str]) -> bytes:
        kms = await self._kms.client()
        try:
            answer = await kms.decrypt(CiphertextBlob=edk, EncryptionContext=dict(ctx), KeyId=kid)
        except Exception as exc:
            raise translate_kms_error(exc, "Decrypt") from exc
        return bytes(answer["Plaintext"])

    async def aclose(self) -> None:
        await self._kms.aclose()


async def kms_public_key(kms: KmsClient, key_id: str) -> tuple[str, bytes]:
    """The ARN and DER public key of an asymmetric KMS signing key (ECC_NIST_P256).

    Raises:
        KeyRefused: KMS refused, or the key is no ECC_NIST_P256 SIGN_VERIFY key.
        KeyServiceError: KMS did not answer.
    """
    try:
        answer = await (await kms.client()).get_public_key(KeyId=key_id)
    except Exception as exc:
        raise translate_kms_error(exc, "GetPublicKey") from exc
    spec = answer.get("KeySpec") or answer.get("CustomerMasterKeySpec")
    if spec != "ECC_NIST_P256" or answer.get("KeyUsage") != "SIGN_VERIFY":
        raise KeyRefused(f"KMS key {key_id}: not an ECC_NIST_P256 SIGN_VERIFY key ({spec})")
    return str(answer["KeyId"]), bytes(answer["PublicKey"])


def translate_kms_error(exc: Exception, what: str) -> KeyServiceError:
    """botocore's errors, as ours; the message names the code, never key material."""
    from botocore.exceptions import BotoCoreError, ClientError

    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        transient = code in (
            "ThrottlingException",
            "KMSInternalException",
            "DependencyTimeoutException",
        )
        kind = KeyServiceError if transient else KeyRefused
        return kind(f"KMS {what}: {code}")
    if isinstance(exc, BotoCoreError | OSError | TimeoutError):
        return KeyServiceError(f"KMS {what}: {type(exc).__name__}")
    return KeyServiceError(f"KMS {what}: {type(exc).__name__}")


def key_source(
    audit_key: bytes,
    key_id: str,
    keyring: Path | None,
    kms_key_id: str | None,
    kms_endpoint: str | None,
    ca_bundle: str | None = None,
) -> KeySource:
    """The one source the settings name (``settings._check_security`` made it one)."""
    if keyring is not None:
        return LocalKeyring(keyring)
    if kms_key_id is not None:
        return KmsKeys(kms_key_id, kms_endpoint, ca_bundle)
    return StaticKey(audit_key, key_id)
