"""The bench's decode references on a machine without a GPU: the GPU readers' skip paths,
their loops over stand-ins for nvImageCodec and its pydicom plugin, the ratios and goals,
the decode corpus, and the crossover diagnostic's summary.
"""

from __future__ import annotations

import io
import sys
import types
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydicom import dcmread
from rich.console import Console

from ingest.bench.config import BenchConfig, s3_target
from ingest.bench.decode import (
    DECODE_GOALS,
    add_decode_rates,
    decode_ratios,
    decode_tasks,
    print_decode_tables,
)
from ingest.bench.decode_gpu import (
    PLUGIN_LABEL,
    PLUGIN_MODULE,
    NvImageCodecReader,
    NvPluginReader,
    nvimgcodec_missing,
)
from ingest.bench.diagnostics.decode_crossover import crossover
from ingest.bench.reader_runs import make_reader, measure_reader
from ingest.bench.readers import ReaderSkipped
from ingest.bench.report import targets
from ingest.bench.workloads import (
    DECODE_WORKLOADS,
    BenchObject,
    S3Target,
    Workload,
    ensure_buckets,
    prepare_workloads,
)
from ingest.bench.workloads_compressed import (
    SERIES,
    corpus_slide,
    frame_bytes,
    series_slice,
    write_corpus,
)
from ingest.cli import bench_config, main, make_parser
from ingest.dicom.codec import decode_encapsulated
from ingest.embedded.stack import Stack
from tests import harness
from tests.reference import reference_array

OFFLINE = S3Target("http://127.0.0.1:1", "us-east-1", "k", "s", "src", "out")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two slices of each series (``SERIES``, the writer's default) and a slide of about 1 MiB."""
    folder = tmp_path_factory.mktemp("corpus")
    write_corpus(folder, SERIES, 2, slide_mb=1)
    return folder


def _series(corpus: Path, name: str) -> Workload:
    files = tuple(sorted((corpus / name).glob("*.dcm")))
    objects = tuple(BenchObject(p.name, p.stat().st_size) for p in files)
    size = frame_bytes(dcmread(files[0], stop_before_pixels=True))
    return Workload(name, objects, len(files), size, files, DECODE_WORKLOADS[name])


def _slide(corpus: Path) -> Workload:
    (path,) = (corpus / "slide").glob("*.dcm")
    workload = corpus_slide(path)
    return Workload(
        "slide",
        (BenchObject(path.name, 1),),
        workload.frames,
        workload.frame_bytes,
        workload.files,
        workload.syntax,
    )


def test_the_corpus_writer_replaces_a_series_and_keeps_to_its_count(tmp_path: Path) -> None:
    first = write_corpus(tmp_path, ("ct-rle",), 3)
    assert first["ct-rle"][0] == 3
    assert "slide" not in first  # no slide unless asked
    assert write_corpus(tmp_path, ("ct-rle",), 2)["ct-rle"][0] == 2
    assert sorted(p.name for p in (tmp_path / "ct-rle").iterdir()) == [
        "slice-0001.dcm",
        "slice-0002.dcm",
    ]
    with pytest.raises(ValueError, match="--write"):
        write_corpus(tmp_path, ("ct-jpeg-ls",), 2)


def test_the_corpus_writer_writes_every_series_by_default(corpus: Path) -> None:
    assert "ct-jpeg" in SERIES
    for name in SERIES:
        assert len(list((corpus / name).glob("*.dcm"))) == 2, name
    jpeg = dcmread(corpus / "ct-jpeg" / "slice-0002.dcm")
    assert jpeg.file_meta.TransferSyntaxUID == DECODE_WORKLOADS["ct-jpeg"]
    assert (jpeg.Rows, jpeg.Columns, jpeg.BitsAllocated) == (512, 512, 8)
    assert jpeg.PhotometricInterpretation == "MONOCHROME2"
    assert (corpus / "ct-jpeg" / "slice-0002.dcm").read_bytes() == series_slice("ct-jpeg", 1)


def test_the_jpeg_series_decodes_in_the_cpu_pool_s_tasks_as_pydicom_does(corpus: Path) -> None:
    """``cpu-pool``'s groups of frames, through the worker's CPU codec, equal pydicom's
    ``pixel_array`` of each slice, a byte a pixel."""
    series = _series(corpus, "ct-jpeg")
    assert series.frame_bytes == 512 * 512
    decoded = [decode_encapsulated(codec, frames) for codec, frames in decode_tasks(series, 1)]
    ours = np.concatenate(decoded)
    expected = np.stack([dcmread(path).pixel_array for path in series.files])
    assert ours.dtype == np.uint8
    assert ours.shape == (2, 512, 512)
    assert ours.nbytes == series.decoded_bytes
    np.testing.assert_array_equal(ours, expected)


@pytest.mark.anyio
@pytest.mark.integration
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("aws_environment")
async def test_the_worker_decodes_the_jpeg_series_on_the_cpu_as_pydicom_does(
    stack: Stack,
) -> None:
    """The worker's CPU twin, end to end, on slices of the ``ct-jpeg`` workload: each output
    equals pydicom's ``pixel_array`` (no Modality LUT) in float32."""
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    objects = {f"ct-jpeg/slice-{i + 1:04d}.dcm": series_slice("ct-jpeg", i) for i in range(3)}
    await harness.upload(stack, names.source_bucket, objects.items())
    messages = [harness.aws_notification(names.source_bucket, [key]) for key in objects]
    await harness.publish(stack, names.source_topic, messages)
    settings = harness.make_settings(stack, names, device="cpu")

    run = await harness.run_worker(settings, stop_after=len(objects))

    assert {o.ref.key: o.error for o in run.outcomes if o.ref} == dict.fromkeys(objects)
    for key, data in objects.items():
        base = f"out/{names.source_bucket}/{key}"
        out = harness.load_npy(await harness.get_object(stack, names.output_bucket, f"{base}.npy"))
        expected = reference_array(data, None, "float32")
        assert out.shape == (1, 512, 512)
        assert out.dtype == np.float32
        assert out.tobytes() == expected.tobytes(), key
        sidecar = harness.load_json(
            await harness.get_object(stack, names.output_bucket, f"{base}.json")
        )
        assert sidecar["backend"] == "cpu"
        assert sidecar["transfer_syntax_uid"] == DECODE_WORKLOADS["ct-jpeg"]


def test_a_series_missing_from_the_corpus_is_refused_with_the_way_to_write_it(
    corpus: Path, tmp_path: Path
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"ct-j2k: no .*workloads_compressed --write DIR"):
        prepare_workloads(OFFLINE, ["ct-j2k"], 4, 1, tmp_path, decode_corpus=empty)


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_the_bench_takes_the_series_and_the_slide_from_the_corpus(
    stack: Stack, corpus: Path, tmp_path: Path
) -> None:
    target = s3_target(BenchConfig(), stack, "corpus")
    ensure_buckets(target)
    got = prepare_workloads(target, ["slide", "ct-htj2k"], 5, 1, tmp_path, decode_corpus=corpus)
    htj2k = got["ct-htj2k"]
    slices = sorted((corpus / "ct-htj2k").glob("*.dcm"))
    assert htj2k.files == tuple(slices[i % 2] for i in range(5))  # cycled over two slices
    assert [o.key for o in htj2k.objects] == [
        f"bench/ct-htj2k/slice-{i:04d}.dcm" for i in range(1, 6)
    ]
    assert dict(htj2k.info)["source"] == {"corpus": str(corpus / "ct-htj2k"), "distinct_slices": 2}
    slide = got["slide"]
    assert slide.files[0].parent == corpus / "slide"
    assert len(slide.objects) == 1
    across, down, tile = dict(slide.info)["tiles"]
    assert (slide.frames, slide.frame_bytes, tile) == (across * down, 256 * 256 * 3, 256)
    assert list(tmp_path.iterdir()) == []  # nothing generated


def test_cli_bench_takes_a_decode_corpus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = make_parser().parse_args(
        ["bench", "--workloads", "ct-htj2k", "--decode-corpus", str(tmp_path)]
    )
    config = bench_config(args)
    assert config.decode_corpus == tmp_path
    assert {"nvimgcodec", "nvimgcodec-plugin"} <= set(config.readers)
    assert main(["bench", "--decode-corpus", str(tmp_path / "absent")]) == 2
    assert "--decode-corpus" in capsys.readouterr().err


@pytest.mark.skipif(nvimgcodec_missing() is None, reason="CUDA and nvImageCodec are here")
@pytest.mark.parametrize("name", ["nvimgcodec", "nvimgcodec-plugin"])
def test_the_gpu_decode_readers_are_skipped_without_cuda_or_nvimgcodec(name: str) -> None:
    entry = make_reader(name, BenchConfig(), OFFLINE)
    assert isinstance(entry, dict)
    assert (entry["status"], entry["short"]) == ("skipped", "GPU only")
    assert entry["note"].startswith("GPU only: ")


class _Refusing:
    name = "refusing"
    closed = False

    def prepare(self, workload: Workload) -> None:
        raise ReaderSkipped("no decoder for this", "CPU only")

    def run(self, workload: Workload) -> dict[str, Any]:
        raise AssertionError("not run after a refusal")

    def close(self) -> None:
        self.closed = True


def test_a_reader_that_cannot_decode_a_workload_is_reported_skipped() -> None:
    reader = _Refusing()
    entry = measure_reader(reader, Workload("ct-rle", ()), 1, [])
    assert entry == {"status": "skipped", "note": "no decoder for this", "short": "CPU only"}
    assert reader.closed


# nvImageCodec and CuPy stand-ins: images of the size the test declares, no decoding
class _Image:
    def __init__(self, shape: tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "version": 3}


def _fake_nvimgcodec(
    monkeypatch: pytest.MonkeyPatch,
    shape: tuple[int, ...],
    typestr: str,
    fail_at: int | None = None,
) -> list[tuple[int, str]]:
    calls: list[tuple[int, str]] = []
    decoded = [0]

    class Decoder:
        def __init__(self, device_id: int, options: str) -> None:
            assert options == ":fancy_upsampling=1"

        def decode(self, streams: list[Any], params: Any, cuda_stream: int) -> list[Any]:
            calls.append((len(streams), params.color_spec))
            out: list[Any] = []
            for _ in streams:
                out.append(None if decoded[0] == fail_at else _Image(shape, typestr))
                decoded[0] += 1
            return out

    def params(allow_any_depth: bool, color_spec: str) -> Any:
        return types.SimpleNamespace(color_spec=color_spec)

    nv = types.SimpleNamespace(
        Decoder=Decoder,
        CodeStream=lambda array: array,
        DecodeParams=params,
        ColorSpec=types.SimpleNamespace(SRGB="srgb", UNCHANGED="unchanged"),
        __version__="0.9.0",
    )
    cuda = types.SimpleNamespace(Device=lambda _=0: types.SimpleNamespace(synchronize=lambda: None))
    monkeypatch.setitem(sys.modules, "nvidia", types.SimpleNamespace(nvimgcodec=nv))
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", nv)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    return calls


def test_the_ceiling_decodes_in_batches_with_the_worker_s_colour(
    corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _fake_nvimgcodec(monkeypatch, (256, 256, 3), "|u1")
    slide = _slide(corpus)
    reader = NvImageCodecReader(batch=16)
    reader.prepare(slide)
    run = reader.run(slide)
    reader.close()
    assert (run["frames"], run["decoded_bytes"]) == (slide.frames, slide.decoded_bytes)
    assert run["decode_calls"] == -(-slide.frames // 16) == len(calls)
    assert {c[1] for c in calls} == {"srgb"}  # YBR_FULL_422 to RGB, as the worker asks
    assert [c[0] for c in calls[:-1]] == [16] * (len(calls) - 1)


def test_the_ceiling_counts_a_frame_it_could_not_decode_as_an_error(
    corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _fake_nvimgcodec(monkeypatch, (512, 512, 1), "<i2", fail_at=1)
    series = _series(corpus, "ct-htj2k")
    reader = NvImageCodecReader()
    reader.prepare(series)
    with pytest.raises(RuntimeError, match="frame 1 did not decode"):
        reader.run(series)
    assert calls == [(2, "unchanged")]  # monochrome: the samples as they are


def test_the_ceiling_decodes_the_jpeg_series_unchanged_a_byte_a_pixel(
    corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _fake_nvimgcodec(monkeypatch, (512, 512, 1), "|u1")
    series = _series(corpus, "ct-jpeg")
    reader = NvImageCodecReader()
    reader.prepare(series)
    run = reader.run(series)
    reader.close()
    assert calls == [(2, "unchanged")]  # MONOCHROME2: no colour conversion
    assert (run["frames"], run["decoded_bytes"]) == (2, 2 * 512 * 512)


def test_the_ceiling_skips_rle_which_only_the_cpu_decodes(
    corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_nvimgcodec(monkeypatch, (512, 512, 1), "<i2")
    with pytest.raises(ReaderSkipped, match="RLE"):
        NvImageCodecReader().prepare(_series(corpus, "ct-rle"))


def _fake_plugin(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """NVIDIA's plugin's interface for JPEG baseline and JPEG 2000 lossless, decoding with
    pydicom's pylibjpeg plugin; returns the frames it decoded (one a call)."""
    from pydicom.pixels.decoders import pylibjpeg
    from pydicom.pixels.decoders.base import get_decoder

    module = types.ModuleType(PLUGIN_MODULE)
    decoders = [get_decoder(DECODE_WORKLOADS[w]) for w in ("ct-j2k", "slide")]
    calls: list[int] = []

    def decode_frame(src: bytes, runner: Any) -> bytes | bytearray:
        calls.append(len(src))
        return pylibjpeg._decode_frame(src, runner)

    def register() -> bool:
        for decoder in decoders:
            decoder.add_plugin(PLUGIN_LABEL, (PLUGIN_MODULE, "_decode_frame"))
        return True

    def unregister() -> bool:
        for decoder in decoders:
            decoder.remove_plugin(PLUGIN_LABEL)
        return True

    module.__dict__.update(
        NVIMGCODEC_PLUGIN_LABEL=PLUGIN_LABEL,
        register=register,
        unregister=unregister,
        is_available=lambda uid: True,
        DECODER_DEPENDENCIES={},
        _decode_frame=decode_frame,
    )
    monkeypatch.setitem(sys.modules, PLUGIN_MODULE, module)
    return calls


@pytest.mark.parametrize("name", ["ct-j2k", "slide", "ct-jpeg"])
def test_the_plugin_reader_decodes_through_the_plugin_then_unregisters_it(
    name: str, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pydicom.pixels.decoders.base import get_decoder

    calls = _fake_plugin(monkeypatch)
    workload = _slide(corpus) if name == "slide" else _series(corpus, name)
    reader = NvPluginReader()
    entry = measure_reader(reader, workload, 1, [])
    assert entry["status"] == "ok"
    assert len(calls) == 2 * workload.frames  # the warm-up and the run, a frame a call
    (run,) = entry["runs"]
    assert (run["decoding_plugin"], run["threads"]) == (PLUGIN_LABEL, 1)
    assert run["pydicom_call"] == ("iter_pixels" if name == "slide" else "pixel_array")
    assert PLUGIN_LABEL not in get_decoder(workload.syntax).available_plugins


def test_the_plugin_reader_skips_a_syntax_the_plugin_does_not_decode(
    corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pydicom.pixels.decoders.base import get_decoder

    _fake_plugin(monkeypatch)
    entry = measure_reader(NvPluginReader(), _series(corpus, "ct-rle"), 1, [])
    assert (entry["status"], entry["short"]) == ("skipped", "no plugin")
    j2k = get_decoder(DECODE_WORKLOADS["ct-j2k"])
    assert PLUGIN_LABEL not in j2k.available_plugins  # unregistered


def _entry(frames_per_s: float) -> dict[str, Any]:
    median = {
        "frames_per_s": frames_per_s,
        "decoded_mb_per_s": frames_per_s / 2,
        "gb_per_s": 0.1,
        "peak_rss_bytes": 3e8,
    }
    return {"status": "ok", "median": median}


def _described(workload: str) -> dict[str, Any]:
    size = {"objects": 1, "frames": 1, "bytes": 1, "decoded_bytes": 1}
    return {"transfer_syntax": DECODE_WORKLOADS[workload]} | size


def _report(gpu: str | None) -> dict[str, Any]:
    report: dict[str, Any] = {
        "machine": {"gpu": gpu},
        "ratios": [],
        "workloads": {w: _described(w) for w in ("slide", "ct-rle")},
        "results": {
            "slide": {
                "pydicom-loop": _entry(100.0),
                "cpu-pool": _entry(400.0),
                "nvimgcodec": _entry(10_000.0),
                "nvimgcodec-plugin": _entry(900.0),
                "ours-hook": _entry(8_500.0),
                "ours": _entry(2_000.0),
            },
            "ct-rle": {
                "pydicom-loop": _entry(50.0),
                "cpu-pool": _entry(90.0),
                "nvimgcodec": {"status": "skipped", "short": "CPU only"},
                "nvimgcodec-plugin": {"status": "skipped", "short": "no plugin"},
                "ours-hook": _entry(80.0),
            },
        },
    }
    report["decode_ratios"] = decode_ratios(report)
    return report


def test_decode_ratios_and_goals_against_every_reference() -> None:
    report = _report("NVIDIA H100 80GB HBM3")
    rows = {(r["workload"], r["mode"]): r for r in report["decode_ratios"]}
    hook = rows[("slide", "ours-hook")]
    assert hook["ours_over_nvimgcodec"] == pytest.approx(0.85)
    assert hook["ours_over_nvimgcodec_plugin"] == pytest.approx(8_500 / 900)
    assert hook["ours_over_cpu_pool"] == pytest.approx(21.25)
    assert hook["nvimgcodec_frames_per_s"] == 10_000.0
    rle = rows[("ct-rle", "ours-hook")]
    assert (rle["ours_over_nvimgcodec"], rle["ours_over_nvimgcodec_plugin"]) == (None, None)
    found = {t["target"]: t for t in targets(report)}
    for reader, goal in DECODE_GOALS["slide"].items():
        t = found[f"decode slide: ours-hook / {reader}"]
        assert (t["goal"], t["status"]) == (f">= {goal:g}", "met"), t
    assert not [t for t in found if t.startswith(("decode ct-rle", "decode slide: ours /"))]
    slower = _report("NVIDIA H100 80GB HBM3")
    slower["results"]["slide"]["ours-hook"] = _entry(7_000.0)
    slower["decode_ratios"] = decode_ratios(slower)
    found = {t["target"]: t for t in targets(slower)}
    assert found["decode slide: ours-hook / nvimgcodec"]["status"] == "missed"  # 0.7 < 0.8


def test_decode_rates_add_the_cpu_a_frame_beside_the_cpu_an_object() -> None:
    workload = Workload("ct-jpeg", (BenchObject("a", 1), BenchObject("b", 1)), 4, 512 * 512)
    run = {"seconds": 2.0, "cpu_s": 0.5, "gb_per_s": 1.0, "cpu_ms_per_object": 250.0}
    entry: dict[str, Any] = {"status": "ok", "runs": [run]}
    add_decode_rates(entry, workload)
    assert run["frames_per_s"] == 2.0
    assert run["cpu_us_per_frame"] == pytest.approx(125_000.0)  # 0.5 s over 4 frames
    assert entry["median"]["cpu_us_per_frame"] == pytest.approx(125_000.0)
    assert entry["median"]["cpu_ms_per_object"] == 250.0
    skipped: dict[str, Any] = {"status": "skipped"}
    add_decode_rates(skipped, workload)
    assert skipped == {"status": "skipped"}


def test_decode_goals_are_judged_on_the_gpu_machine_only() -> None:
    found = {t["target"]: t for t in targets(_report(None))}
    assert found["decode slide: ours-hook / cpu-pool"]["status"] == "n/a here (gpu target)"
    for gpu, cell in ((None, "21.250 (>= 10)"), ("H100", "21.250 (>= 10 met)")):
        out = io.StringIO()
        print_decode_tables(Console(file=out, width=250), _report(gpu))
        text = out.getvalue()
        assert cell in text
        assert "skipped: CPU only" in text  # ct-rle's nvimgcodec row
        assert "0.850 (>= 0.8" in text


def test_the_crossover_is_where_the_gpu_stays_ahead() -> None:
    def case(name: str, size: int) -> Any:
        return types.SimpleNamespace(name=name, size=size)

    rows = [
        (case("jpeg", 16), 50.0, 10.0),  # ahead at 16 but not at 32: not a crossover
        (case("jpeg", 32), 5.0, 10.0),
        (case("jpeg", 64), 30.0, 10.0),
        (case("jpeg", 128), 40.0, 10.0),
        (case("htj2k", 64), None, 10.0),  # no GPU figure
        (case("j2k", 64), 1.0, 10.0),
    ]
    assert crossover(rows) == {"jpeg": 64, "htj2k": None, "j2k": None}
