"""Every command in the code blocks of ``docs/operations.md``, run as written.

The commands are read from the runbook's ``sh`` blocks (continuation lines
joined, comment lines dropped) and each goes through ``bash`` as it stands.
Each must match a case below, so a command added to the runbook without a run
here fails ``test_every_runbook_command_is_run_here``. Where a command needs
what CI has not, the nearest offline form of the same command runs instead:

- ``docker-compose ... up -d --build`` needs an engine: the same command with
  ``config -q`` in place of ``up -d --build`` (the file and profile ``up``
  reads, checked as ``up`` checks them).
- ``kubectl`` needs a cluster: ``create secret`` with ``--dry-run=client -o
  yaml``; ``apply -k DIR`` as ``kubectl kustomize DIR`` (what apply sends).

The Compose commands run in a copy of ``compose/`` (the runbook's ``cp``
writes ``compose/.env``); the ``dicom-ingest dlq replay`` commands run the
installed command against the embedded stack, with a dead-letter topic a
worker filled; the ``dicom-ingest backfill`` commands run it against a bucket of
CT slices, whose notifications workers then process.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from ingest.embedded.stack import Stack, create_topics
from tests import harness
from tests.paths import ROOT

RUNBOOK = ROOT / "docs" / "operations.md"
BIN = Path(sys.executable).parent  # the virtual environment's dicom-ingest


def runbook_commands() -> list[str]:
    """The command lines of the runbook's ``sh`` blocks, in order."""
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", RUNBOOK.read_text(), re.S):
        for line in re.sub(r"\\\n\s*", "", block).splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                commands.append(line.strip())
    return commands


def bash(command: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    """Run one command line as written; its standard output."""
    done = subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (command, done.stdout, done.stderr)
    return done.stdout


def needs(tool: str) -> None:
    if shutil.which(tool) is None:
        message = f"{tool} not installed here"
        if os.environ.get("CI") and tool == "docker-compose":
            pytest.fail(message)  # .ci/run installs it: CI must run these
        pytest.skip(message)


CASES: dict[str, Callable[[str], bool]] = {
    "compose": lambda c: c.startswith(
        ("cp compose/", "docker-compose ", 'python3 -c "import base64')
    ),
    "kubectl": lambda c: c.startswith("kubectl "),
    "replay": lambda c: c.startswith("dicom-ingest dlq replay"),
    "backfill": lambda c: c.startswith("dicom-ingest backfill"),
}


def of_case(name: str) -> list[str]:
    return [c for c in runbook_commands() if CASES[name](c)]


def test_every_runbook_command_is_run_here() -> None:
    commands = runbook_commands()
    assert len(commands) >= 10  # the parse found the blocks
    assert [c for c in commands if not any(case(c) for case in CASES.values())] == []


def test_the_compose_commands(tmp_path: Path) -> None:
    needs("docker-compose")
    shutil.copytree(ROOT / "compose", tmp_path / "compose")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DICOM_INGEST_", "COMPOSE_"))}
    key = ""
    ran = 0
    for command in of_case("compose"):
        if command.startswith("python3"):
            key = bash(command, tmp_path, env).strip()
            assert len(base64.b64decode(key, validate=True)) == 32
            # "put it in compose/.env as DICOM_INGEST_AUDIT_KEY=..."
            dotenv = tmp_path / "compose" / ".env"
            text = dotenv.read_text()
            assert "\nDICOM_INGEST_AUDIT_KEY=\n" in text
            dotenv.write_text(
                text.replace("DICOM_INGEST_AUDIT_KEY=\n", f"DICOM_INGEST_AUDIT_KEY={key}\n")
            )
        elif command.startswith("docker-compose"):
            offline = command.replace("up -d --build", "config -q")
            assert bash(offline, tmp_path, env) == ""  # -q: valid, nothing printed
        else:
            bash(command, tmp_path, env)
        ran += 1
    assert key  # the key was made and used
    assert ran == len(of_case("compose"))


def test_the_kubectl_commands() -> None:
    needs("kubectl")
    for command in of_case("kubectl"):
        if command.startswith("kubectl create secret"):
            secret = yaml.safe_load(bash(f"{command} --dry-run=client -o yaml", ROOT))
            assert secret["kind"] == "Secret"
            assert set(secret["data"]) == {
                "DICOM_INGEST_AUDIT_KEY",
                "AWS_ACCESS_KEY_ID",
                "AWS_SECRET_ACCESS_KEY",
            }
            key = base64.b64decode(secret["data"]["DICOM_INGEST_AUDIT_KEY"]).decode()
            assert len(base64.b64decode(key.strip(), validate=True)) == 32
        else:
            match = re.fullmatch(r"kubectl apply -k (\S+)", command)
            assert match, command
            kinds = {
                d["kind"]
                for d in yaml.safe_load_all(bash(f"kubectl kustomize {match[1]}", ROOT))
                if d
            }
            assert {"Deployment", "ConfigMap", "ScaledObject"} <= kinds


@pytest.mark.anyio
@pytest.mark.integration
@pytest.mark.timeout(180)
async def test_the_replay_commands(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker dead-letters a missing object under the runbook's key prefix; the
    runbook's three replay commands then show it, replay it, and find it replayed."""
    for name, value in stack.endpoints.environment().items():  # the worker's S3 login
        monkeypatch.setenv(name, value)
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    create_topics(stack.kafka.bootstrap, [names.dlq_topic + ".replayed"])
    key = "studies/2026-11-24/missing.dcm"
    await harness.publish(
        stack, names.source_topic, [harness.aws_notification(names.source_bucket, [key])]
    )
    run = await harness.run_worker(harness.make_settings(stack, names), stop_after=1)
    assert [o.error.reason for o in run.outcomes if o.error] == ["not_found"]
    path = f"{BIN}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, **harness.worker_environment(stack, names), "PATH": path}
    outputs = [bash(command, ROOT, env) for command in of_case("replay")]
    assert len(outputs) == 3
    topic = names.source_topic
    assert outputs[0].startswith(f"would replay 1 to {topic} (not_found 1)")  # --dry-run
    assert outputs[1].startswith(f"replayed 1 to {topic} (not_found 1)")  # by reason
    assert outputs[2].startswith(f"replayed 0 to {topic} (none)")  # by prefix and time: done
    assert "1 replayed before" in outputs[2]


@pytest.mark.anyio
@pytest.mark.integration
@pytest.mark.timeout(180)
async def test_the_backfill_commands(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The runbook's backfills of an archive: a dry run, a paced run the worker then
    processes, and a re-run of the preprocessing (a window) into a topic and output prefix
    of its own, which leaves the first outputs as they were."""
    for name, value in stack.endpoints.environment().items():  # the worker's S3 login
        monkeypatch.setenv(name, value)
    commands = of_case("backfill")
    assert len(commands) == 3
    bucket = "pacs-archive"  # as the runbook names it
    archive = {f"studies/{k}": v for k, v in harness.corpus().items() if k.startswith("ct/")}
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    stack.s3.create_bucket(bucket)
    await harness.upload(stack, bucket, archive.items())
    reprocess = "s3-events.reprocess-2026-11"
    create_topics(stack.kafka.bootstrap, [reprocess])
    path = f"{BIN}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, **harness.worker_environment(stack, names), "PATH": path}
    dry, paced, again = (bash(command, tmp_path, env) for command in commands)
    count = len(archive)
    assert dry.startswith(f"backfill s3://{bucket}/studies/: would publish {count} ")
    assert paced.startswith(f"backfill s3://{bucket}/studies/: published {count} ")
    assert again.startswith(
        f"backfill s3://{bucket}/studies/: published {count} notifications to {reprocess}"
    )

    first = await harness.run_worker(harness.make_settings(stack, names), stop_after=count)
    assert sorted(harness.keys_of(first.outcomes)) == sorted(archive)
    old = {
        k: await harness.get_object(stack, names.output_bucket, f"out/{bucket}/{k}.npy")
        for k in archive
    }
    settings = harness.make_settings(
        stack,
        names,
        source_topic=reprocess,
        group_id=names.group + "-reprocess",
        output_url=f"s3://{names.output_bucket}/reprocess-2026-11/",
        window="40,400",
    )
    second = await harness.run_worker(settings, stop_after=count)
    assert [o.error for o in second.outcomes] == [None] * count
    for key in archive:
        new = await harness.get_object(
            stack, names.output_bucket, f"reprocess-2026-11/{bucket}/{key}.npy"
        )
        assert harness.load_npy(new).max() <= 1.0  # windowed to [0, 1]
        assert new != old[key]
        kept = await harness.get_object(stack, names.output_bucket, f"out/{bucket}/{key}.npy")
        assert kept == old[key]  # the first outputs are as they were
