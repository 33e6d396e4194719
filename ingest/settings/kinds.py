"""How a setting is declared: the kind of its value, its table and what it does.

``model.py`` declares each setting once, as a ``Settings`` field made by
``contract``, ``tuning`` or ``security`` (the table of docs/configuration.md it
is listed in) from its default, its ``Kind`` and what it does. A ``Kind``
parses a setting's text and checks it (its bounds or choices) and says what it
accepts in words an operator reads; the loader, ``setting_names`` and the
documentation (``ingest/ops/config_doc.py``) all read these declarations.

A kind's parser raises ``ConfigError`` saying what is wrong with the text; the
loader puts the variable's name in front, so every message names it.
"""

from __future__ import annotations

import base64
import binascii
import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Generic, Literal, TypeVar, get_args
from urllib.parse import urlparse

from ingest.errors import ConfigError

T = TypeVar("T")
Group = Literal["contract", "tuning", "security"]
METADATA: Final = "setting"  # the key of a field's declaration in its metadata


@dataclass(frozen=True, slots=True)
class Kind(Generic[T]):
    """How a setting's text becomes its value."""

    parse: Callable[[str], T]  # raises ConfigError with what is wrong
    shown: str  # what it accepts, in docs/configuration.md's type column
    low: int | float | None = None  # a number's bounds, both included
    high: int | float | None = None


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting's declaration, besides its field's name, type and default."""

    kind: Kind[Any]
    doc: str  # what it does: docs/configuration.md's meaning column
    group: Group
    required: bool  # by the worker: ``load_settings``' default ``required``


def _declare(
    group: Group, default: T, kind: Kind[Any], doc: str, required: bool, secret: bool
) -> T:
    declared = Setting(kind, doc, group, required)
    made: T = field(default=default, repr=not secret, metadata={METADATA: declared})
    return made


def contract(
    default: T, kind: Kind[Any], doc: str, *, required: bool = False, secret: bool = False
) -> T:
    """A setting of the worker's contract: its topics, its outputs, what it computes.

    ``required``: the worker does not start without it; ``secret``: never in a repr.
    """
    return _declare("contract", default, kind, doc, required, secret)


def tuning(default: T, kind: Kind[Any], doc: str) -> T:
    """A setting of tuning and operations."""
    return _declare("tuning", default, kind, doc, False, False)


def security(default: T, kind: Kind[Any], doc: str, *, secret: bool = False) -> T:
    """A setting of security: keys, TLS, SASL, encryption (docs/security.md)."""
    return _declare("security", default, kind, doc, False, secret)


def integer(low: int, high: int) -> Kind[int]:
    """An integer within ``[low, high]``, in any base Python reads, ``_`` allowed."""

    def parse(raw: str) -> int:
        try:
            value = int(raw.replace("_", ""), 0)
        except ValueError:
            raise ConfigError(f"not an integer: {raw!r}") from None
        if not low <= value <= high:
            raise ConfigError(f"{value} is outside [{low}, {high}]")
        return value

    return Kind(parse, "integer", low, high)


def number(low: float, high: float) -> Kind[float]:
    """A number within ``[low, high]``."""

    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"not a number: {raw!r}") from None
        if not low <= value <= high:
            raise ConfigError(f"{value} is outside [{low}, {high}]")
        return value

    return Kind(parse, "number", low, high)


def one_of(choices: Any, empty: str | None = None) -> Kind[Any]:
    """One of a ``Literal``'s values, in any case (``empty``: what an empty text means)."""
    allowed: tuple[str, ...] = get_args(choices)
    by_folded = {choice.casefold(): choice for choice in allowed}

    def parse(raw: str) -> str:
        text = raw.strip()
        if not text and empty is not None:
            return empty
        if text.casefold() not in by_folded:
            raise ConfigError(f"{raw!r} is not one of {', '.join(allowed)}")
        return by_folded[text.casefold()]

    return Kind(parse, "one of " + ", ".join(f"`{choice}`" for choice in allowed))


def parse_window(raw: str) -> tuple[float, float] | None:
    """``none`` or ``CENTER,WIDTH`` with WIDTH >= 1 (DICOM C.11.2.1.2).

    Raises:
        ConfigError: anything else.
    """
    text = raw.strip().lower()
    if text in ("", "none"):
        return None
    parts = text.split(",")
    bad = ConfigError(f"expected 'none' or 'CENTER,WIDTH', got {raw!r}")
    if len(parts) != 2:
        raise bad
    try:
        center, width = float(parts[0]), float(parts[1])
    except ValueError:
        raise bad from None
    if width < 1:
        raise ConfigError(f"width must be >= 1, got {width}")
    return center, width


def parse_audit_key(raw: str) -> bytes:
    """The 32 bytes of an AES-256 key given in base64.

    Raises:
        ConfigError: not base64, or not 32 bytes.
    """
    try:
        key = base64.b64decode(raw.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError("not valid base64") from None
    if len(key) != 32:
        raise ConfigError(f"must decode to 32 bytes, got {len(key)}")
    return key


_ROOT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def parse_file_roots(raw: str) -> tuple[tuple[str, str], ...]:
    """``NAME=PATH,NAME=PATH``: the folders ``file://`` notifications may name, each under
    the name that stands for a bucket in its objects' output keys. Paths are absolute and
    normalised; names are distinct, and so are paths.

    Raises:
        ConfigError: anything else.
    """
    roots: list[tuple[str, str]] = []
    for item in (part.strip() for part in raw.split(",")):
        if not item:
            continue
        name, sep, path = (text.strip() for text in item.partition("="))
        if not sep or not _ROOT_NAME.fullmatch(name):
            raise ConfigError(
                f"expected NAME=/absolute/path with NAME like a bucket's, got {item!r}"
            )
        if not path.startswith("/") or "\x00" in path:
            raise ConfigError(f"root {name}: the path must be absolute")
        roots.append((name, posixpath.normpath(path)))
    names, paths = [n for n, _ in roots], [p for _, p in roots]
    if len(set(names)) != len(names) or len(set(paths)) != len(paths):
        raise ConfigError("two roots share a name or a path")
    return tuple(roots)


def _nonempty(raw: str) -> str:
    if not raw.strip():
        raise ConfigError("must not be empty")
    return raw.strip()


def _s3_url(raw: str) -> str:
    url = urlparse(raw)
    if url.scheme != "s3" or not url.netloc:
        raise ConfigError(f"expected s3://bucket/prefix/, got {raw!r}")
    return raw if raw.endswith("/") else raw + "/"


def _endpoint(raw: str) -> str | None:
    if not raw.strip():
        return None
    url = urlparse(raw)
    if url.username is not None or url.password is not None:  # never echo a credential
        raise ConfigError("expected http(s)://host:port, got a URL with a user name or password")
    if url.scheme not in ("http", "https") or not url.netloc:
        raise ConfigError(f"expected http(s)://host:port, got {raw!r}")
    return raw


def _flag(raw: str) -> bool:
    text = raw.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("", "0", "false", "no", "off"):
        return False
    raise ConfigError(f"expected true or false, got {raw!r}")


def _file(raw: str) -> Path | None:
    """A file that must exist when set (keys, certificates): a typo fails at start-up."""
    if not raw.strip():
        return None
    path = Path(raw.strip()).expanduser()
    if not path.is_file():
        raise ConfigError(f"no such file: {raw.strip()!r}")
    return path


def _optional(raw: str) -> str | None:
    return raw.strip() or None


def _verbatim(raw: str) -> str | None:
    return raw or None


def _folder(raw: str) -> Path | None:
    return Path(raw.strip()) if raw.strip() else None


TEXT: Final = Kind(_nonempty, "text")  # stripped, not empty
OPTIONAL_TEXT: Final = Kind(_optional, "text")  # stripped; empty: unset
SECRET_TEXT: Final = Kind(_verbatim, "text")  # as it is, spaces included; empty: unset
ANY_TEXT: Final = Kind(str, "text")
S3_URL: Final = Kind(_s3_url, "text")  # s3://bucket/prefix/, the last slash added
ENDPOINT: Final = Kind(_endpoint, "text")  # http(s)://host:port; empty: unset
FLAG: Final = Kind(_flag, "`true` or `false`")
FILE: Final = Kind(_file, "path")  # an existing file; empty: unset
FOLDER: Final = Kind(_folder, "path")  # made when it is used; empty: unset
WINDOW: Final = Kind(parse_window, "`none` or `CENTER,WIDTH`")
AES_KEY: Final = Kind(parse_audit_key, "base64")
FILE_ROOTS: Final = Kind(parse_file_roots, "`NAME=PATH,...`")
