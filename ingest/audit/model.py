"""The DICOM audit message model (PS3.15 Annex A.5, after RFC 3881) of one audit record.

Every sealed record carries, beside its flat fields (``event``, ``outcome``,
``bucket``, ``key`` ...: docs/security.md, "Audit record format"), a ``dicom_audit``
object: the A.5 ``AuditMessage`` rendered as JSON, element names kept, coded values as
``{"code", "codeSystemName", "displayName"}``. The mapping (docs/security.md
has the table):

- ``object.processed``      EventID 110104 DICOM Instances Transferred, action C,
                             outcome 0; the source store is the Source Role
                             (110153), the worker the Destination Role (110152).
- ``object.dead_lettered``  EventID 110107 Import, action C, outcome 8: an object
                             that may not be DICOM at all, so no Study is required.
- ``notification.dead_lettered``  110107 Import, outcome 8, the Kafka record.
- ``application.start`` / ``.stop``  EventID 110100 Application Activity, action E,
                             EventTypeCode 110120 Application Start / 110121 Stop.
- ``audit_log.used``        EventID 110101 Audit Log Used, action R: ``audit export``
                             or ``decrypt`` read the trail (``key``: its URI,
                             ``reason``: the verb); the log is a Security Resource.

Participant objects: the patient (type 1 person, role 1 patient, RFC 3881
ParticipantObjectIDTypeCode 2 Patient Number: the Patient ID, as IHE ATNA expects;
the record is encrypted, and no name is kept), the study (ParticipantObjectIDTypeCode
110180 Study Instance UID, type 2 system object, role 3 report) with the SOP class
and instance in ``ParticipantObjectDescription.SOPClass`` (where A.5 puts them)
and the series UID as a ``ParticipantObjectDetail``; the S3 object as a URI
(RFC 3881 ParticipantObjectIDTypeCode 12) with its bucket, key, version and ETag
as details.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

DCM: Final = "DCM"
RFC3881: Final = "RFC-3881"

_EVENTS: Final[dict[str, tuple[str, str, str, str | None]]] = {
    # event: (EventID code, displayName, EventActionCode, EventTypeCode)
    "object.processed": ("110104", "DICOM Instances Transferred", "C", None),
    "object.dead_lettered": ("110107", "Import", "C", None),
    "notification.dead_lettered": ("110107", "Import", "C", None),
    "application.start": ("110100", "Application Activity", "E", "110120"),
    "application.stop": ("110100", "Application Activity", "E", "110121"),
    "audit_log.used": ("110101", "Audit Log Used", "R", None),
}
EVENTS: Final = frozenset(_EVENTS)
_TYPE_NAMES: Final = {"110120": "Application Start", "110121": "Application Stop"}
OUTCOME_SUCCESS: Final = "0"
OUTCOME_SERIOUS_FAILURE: Final = "8"  # the action was terminated: the object is dead-lettered


def coded(code: str, display: str, system: str = DCM) -> dict[str, str]:
    return {"code": code, "codeSystemName": system, "displayName": display}


@dataclass(frozen=True, slots=True)
class Participant:
    """The worker as an active participant: its id, host and process."""

    worker: str
    host: str
    pid: int


def audit_message(
    record: dict[str, Any], me: Participant, s3_endpoint: str | None
) -> dict[str, Any]:
    """The A.5 ``AuditMessage`` for one flat record (as ``AuditTrail.seal`` builds it)."""
    event = record["event"]
    code, display, action, type_code = _EVENTS[event]
    ident: dict[str, Any] = {
        "EventID": coded(code, display),
        "EventActionCode": action,
        "EventDateTime": record["time"],
        "EventOutcomeIndicator": OUTCOME_SUCCESS
        if record["outcome"] == "success"
        else OUTCOME_SERIOUS_FAILURE,
    }
    if type_code is not None:
        ident["EventTypeCode"] = [coded(type_code, _TYPE_NAMES[type_code])]
    if record.get("reason") and record["outcome"] != "success":
        ident["EventOutcomeDescription"] = f"{record['reason']}: {record.get('error') or ''}"
    worker = {
        "UserID": me.worker,
        "AlternativeUserID": str(me.pid),
        "UserIsRequestor": True,
        "NetworkAccessPointID": me.host,
        "NetworkAccessPointTypeCode": "1",  # machine name
        "RoleIDCode": [coded("110152", "Destination Role ID")],
    }
    if event.startswith(("application.", "audit_log.")):
        worker["RoleIDCode"] = [coded("110150", "Application")]
    active = [worker]
    if event == "object.processed":
        active.insert(
            0,
            {
                "UserID": s3_endpoint or "s3.amazonaws.com",
                "UserIsRequestor": False,
                "RoleIDCode": [coded("110153", "Source Role ID")],
            },
        )
    return {
        "EventIdentification": ident,
        "ActiveParticipant": active,
        "AuditSourceIdentification": {"AuditSourceID": me.worker},
        "ParticipantObjectIdentification": _objects(record),
    }


def _objects(record: dict[str, Any]) -> list[dict[str, Any]]:
    objects: list[dict[str, Any]] = []
    if record.get("patient_id"):
        objects.append(
            {
                "ParticipantObjectID": record["patient_id"],
                "ParticipantObjectTypeCode": "1",  # person
                "ParticipantObjectTypeCodeRole": "1",  # patient
                "ParticipantObjectIDTypeCode": coded("2", "Patient Number", RFC3881),
            }
        )
    if record.get("study_instance_uid"):
        study: dict[str, Any] = {
            "ParticipantObjectID": record["study_instance_uid"],
            "ParticipantObjectTypeCode": "2",
            "ParticipantObjectTypeCodeRole": "3",
            "ParticipantObjectIDTypeCode": coded("110180", "Study Instance UID"),
        }
        details = []
        if record.get("series_instance_uid"):
            details.append({"type": "SeriesInstanceUID", "value": record["series_instance_uid"]})
        if details:
            study["ParticipantObjectDetail"] = details
        if record.get("sop_instance_uid"):
            study["ParticipantObjectDescription"] = {
                "SOPClass": [
                    {
                        "UID": record.get("sop_class_uid"),
                        "NumberOfInstances": 1,
                        "Instance": [{"UID": record["sop_instance_uid"]}],
                    }
                ]
            }
        objects.append(study)
    if record.get("bucket") and record["event"] != "audit_log.used":
        details = [
            {"type": "Bucket", "value": record["bucket"]},
            {"type": "Key", "value": record["key"]},
        ]
        for name, field in (("VersionId", "version_id"), ("ETag", "etag")):
            if record.get(field):
                details.append({"type": name, "value": record[field]})
        objects.append(
            {
                "ParticipantObjectID": f"s3://{record['bucket']}/{record['key']}",
                "ParticipantObjectTypeCode": "2",
                "ParticipantObjectTypeCodeRole": "3",
                "ParticipantObjectIDTypeCode": coded("12", "URI", RFC3881),
                "ParticipantObjectDetail": details,
            }
        )
    if record["event"] == "audit_log.used":
        objects.append(
            {
                "ParticipantObjectID": record["key"],
                "ParticipantObjectTypeCode": "2",
                "ParticipantObjectTypeCodeRole": "13",  # security resource
                "ParticipantObjectIDTypeCode": coded("12", "URI", RFC3881),
                "ParticipantObjectDetail": [{"type": "Use", "value": record.get("reason")}],
            }
        )
    for output in record.get("outputs") or ():
        objects.append(
            {
                "ParticipantObjectID": output,
                "ParticipantObjectTypeCode": "2",
                "ParticipantObjectTypeCodeRole": "3",
                "ParticipantObjectIDTypeCode": coded("12", "URI", RFC3881),
                "ParticipantObjectDataLifeCycle": "1",  # origination / creation
            }
        )
    return objects
