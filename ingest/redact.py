"""Keeping patient data and secrets out of every log line, error text and dead letter.

``redact_event`` is a structlog processor (``logs.configure_logging`` puts it
before the renderer, after the exception is formatted, so tracebacks are
scrubbed too); ``scrub_text`` is the same cleaning for one string (the
dead-letter record's ``error``). What it does:

- fields named after a patient attribute (name, ID, birth date, sex, age,
  address, telephone, accession number, other patient IDs, comments and other
  free text, institution and physician names) are replaced by ``[phi]``;
- fields named after a secret (keys, passwords, tokens, credentials,
  signatures, authorization, cookies) are replaced by ``[secret]``;
- ``key`` / ``object_key`` / ``source_key`` values that are not already a
  ``key_hash`` are hashed: object keys may hold patient names;
- in every string: presigned URL signatures, credentials and security tokens
  (``X-Amz-Signature=...`` and the like), ``Authorization`` headers, the path
  and query of any URL and the key of any ``s3://`` URI (hashed: they hold
  object keys), DICOM person names (``FAMILY^GIVEN``), the value after a
  patient attribute's keyword or tag (``PatientName='...'``, ``(0010,0010)``),
  and the value of any data element as pydicom prints one
  (``(0010,0020) Patient ID  LO: 'X'``) are masked.

Hashes are keyed (``key_hash``: HMAC-SHA-256 under the deployment's
``LOG_HASH_KEY``, else a key made for this process), so a reader of the logs
cannot try the few million candidates of a structured key (a record number, a
date) against them; a holder of the key can still find one object's lines.

It is a net under the rule that code never logs header values or raw keys,
not a replacement for it: a free-text value with no marker cannot be told
from any other text.
"""

from __future__ import annotations

import functools
import hmac
import logging
import os
import re
from collections.abc import Mapping, MutableMapping
from typing import Any, Final

PHI_FIELDS: Final = frozenset(
    {
        "patient_name",
        "patientname",
        "patient_id",
        "patientid",
        "patient_birth_date",
        "patientbirthdate",
        "birth_date",
        "birthdate",
        "patient_sex",
        "patient_age",
        "patient_address",
        "patientaddress",
        "address",
        "patient_telephone_numbers",
        "accession_number",
        "accessionnumber",
        "other_patient_ids",
        "otherpatientids",
        "other_patient_names",
        "patient_comments",
        "image_comments",
        "study_description",
        "series_description",
        "institution_name",
        "institution_address",
        "referring_physician_name",
        "performing_physician_name",
        "operators_name",
        "free_text",
        "comments",
        "patient",
    }
)
_SECRET_WORDS: Final = (
    "password",
    "passwd",
    "secret",
    "token",
    "credential",
    "signature",
    "authorization",
    "cookie",
    "private_key",
    "audit_key",
    "data_key",
    "api_key",
    "access_key",
)
KEY_FIELDS: Final = frozenset({"key", "object_key", "source_key", "s3_key"})
_DIGEST = re.compile(r"^[0-9a-f]{16}$")
_PATTERNS: Final = (
    # presigned URL query parameters and headers that carry secrets
    (re.compile(r"(?i)(X-Amz-(?:Signature|Credential|Security-Token)=)[^&\s\"']+"), r"\1[secret]"),
    (re.compile(r"(?i)(Signature=|AWSAccessKeyId=|sig=)[^&\s\"']+"), r"\1[secret]"),
    (re.compile(r"(?i)(authorization[\"']?\s*[:=]\s*[\"']?)[^\"',}]+"), r"\1[secret]"),
    (
        re.compile(r"(?i)((?:password|secret|token)[\"']?\s*[:=]\s*[\"']?)[^\s\"',}]+"),
        r"\1[secret]",
    ),
)
_URL = re.compile(r"\b(https?://[^/\s\"'?#]+)(/[^\s\"'<>]*)?")
_S3_URI = re.compile(r"\bs3://([^/\s\"']+)/([^\s\"'<>]*)")
_PERSON_NAME = re.compile(r"[A-Za-z0-9'.-]+(?:\^[A-Za-z0-9'. -]*)+")
# A data element as pydicom's str() and repr() print it: "(0010,0020) Patient ID  LO: 'X'"
_ELEMENT = re.compile(
    r"(\([0-9A-Fa-f]{4},\s?[0-9A-Fa-f]{4}\)[^:\n]{0,80}?\s[A-Z]{2}:\s*)"
    r"(?:'[^'\n]*'|\"[^\"\n]*\"|\[[^\]\n]*\]|[^\s,;]+)"
)
_PHI_KEYWORD = re.compile(
    r"(?i)(?<!\w)(Patient(?:Name|ID|BirthDate|Address|Sex|Age|TelephoneNumbers|Comments)|"
    r"OtherPatient(?:IDs|Names)|AccessionNumber|ImageComments|StudyDescription|"
    r"InstitutionName|ReferringPhysicianName|\(00(?:10|08),[0-9a-f]{4}\))"
    r"(\s*(?:[:=]|value|of)?\s*)(?:'[^']*'|\"[^\"]*\"|[^\s,;)]+)"
)


_hash_key = os.urandom(32)  # this process's, until ``set_log_hash_key``


def set_log_hash_key(key: bytes | None) -> None:
    """Key every later hash with the deployment's secret (None: a key for this process)."""
    global _hash_key
    _hash_key = key or os.urandom(32)


def key_hash(text: str) -> str:
    """A short stable stand-in for an object key (or path) in logs: 16 hex digits of its
    HMAC-SHA-256 under the log hash key.

    Through an ``hmac.new`` object, not the one-shot ``hmac.digest``, which lets go of
    the GIL for every call: on the event loop, with the GET and device threads busy,
    each call then waited for the GIL to come back (up to ``GIL_SWITCH_MS``) once or
    more an object. An object's update keeps the GIL for a key's few bytes.
    """
    data = text.encode("utf-8", "surrogatepass")
    return hmac.new(_hash_key, data, "sha256").digest()[:8].hex()


_hash = key_hash


def _path(path: str | None) -> str:
    return f"/<{_hash(path)}>" if path and path != "/" else path or ""


# Every pattern above needs one of these to match: "=", "^", "(", "//" or a word it names;
# a text with none (most log fields: event names, digests, topics, numbers) is left as it is
# without running them.
_MAY_MATCH = re.compile(
    r"(?i)[=^(]|//|authorization|password|secret|token|patient|accession|imagecomments"
    r"|studydescription|institutionname|referringphysicianname"
)


def scrub_text(text: str) -> str:
    """``text`` with secrets, object keys in URLs, person names and PHI values masked."""
    return text if _MAY_MATCH.search(text) is None else scrub_every_pattern(text)


def scrub_every_pattern(text: str) -> str:
    """``scrub_text`` without its shortcut: every pattern run over ``text``."""
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    text = _URL.sub(lambda m: m.group(1) + _path(m.group(2)), text)
    text = _S3_URI.sub(lambda m: f"s3://{m.group(1)}/<{_hash(m.group(2))}>", text)
    text = _ELEMENT.sub(lambda m: f"{m.group(1)}[phi]", text)
    text = _PHI_KEYWORD.sub(lambda m: f"{m.group(1)}{m.group(2)}[phi]", text)
    return _PERSON_NAME.sub("[phi]", text)


@functools.lru_cache(maxsize=1024)  # a log event's field names are few, and repeat
def _field_kind(name: str) -> str | None:
    lowered = name.lower()
    if lowered in PHI_FIELDS:
        return "[phi]"
    if any(word in lowered for word in _SECRET_WORDS):
        return "[secret]"
    return None


_PLAIN: Final = frozenset({int, float, bool, type(None)})  # nothing in them to scrub


def _clean(value: Any, depth: int = 0) -> Any:
    kind = type(value)
    if kind is str:
        return scrub_text(value)
    if kind in _PLAIN:
        return value
    if isinstance(value, str):
        return scrub_text(value)
    if depth > 4:
        return value
    if isinstance(value, Mapping):
        return {k: _clean_field(str(k), v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v, depth + 1) for v in value]
    if isinstance(value, BaseException):
        return scrub_text(f"{type(value).__name__}: {value}")
    return value


def _clean_field(name: str, value: Any, depth: int = 0) -> Any:
    kind = _field_kind(name)
    if kind is not None and value is not None:
        return kind
    if name in KEY_FIELDS and isinstance(value, str) and not _DIGEST.match(value):
        return _hash(value)
    return _clean(value, depth)


class RedactFilter(logging.Filter):
    """The same cleaning for the standard library's log records (aiokafka, botocore)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = scrub_text(record.getMessage()), ()
        if record.exc_info:
            import traceback

            # The scrubbed traceback replaces the live one: a plain formatter appends
            # ``exc_text`` to the line; ``ingest/logs.py`` makes it the ``exception`` field.
            text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
            record.exc_info, record.exc_text = None, scrub_text(text)
        elif record.exc_text:
            record.exc_text = scrub_text(record.exc_text)
        return True


def redact_event(
    _logger: Any, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """The structlog processor: every field of the event, the message and traceback too."""
    for name, value in list(event.items()):
        if name in _OURS:
            continue
        event[name] = _clean_field(name, value)
    return event


# Fields this package's own processors set from values it made (the time, the level, the
# logger's and the service's names, the version): nothing in them to scrub
_OURS: Final = frozenset({"timestamp", "level", "logger", "service", "version"})
