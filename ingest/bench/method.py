"""How every figure of the bench was taken, in words (written into the report's JSON)."""

from __future__ import annotations

from ingest.bench.decode import METHOD as DECODE_METHOD


def method(repeats: int, concurrency: int, part_mb: int, hook: str) -> dict[str, str]:
    """How every figure was taken (written into the JSON)."""
    return {
        "repeats": f"{repeats} measured runs per reader and workload",
        "warmup": "readers: one full run first, discarded; ours: one full pass first, discarded "
        "(sweep points: one CT slice)",
        "ours_modes": "ours: DICOM_INGEST_SINK=s3; ours-hook: DICOM_INGEST_SINK=none and "
        f"DICOM_INGEST_HOOK={hook} (a no-op hook on the device thread)",
        "statistic": "ratios use the median of the measured runs on both sides; "
        "'best' is the run with the highest GB/s",
        "throughput": "source object bytes / seconds; ours: from the first notification "
        "published to the last outcome reported",
        "latency": "ours: Outcome callback time (after output, sidecar, acknowledged result "
        "event and audit record) minus the time just before the notification was handed "
        "to the producer; 'burst' publishes everything at once (includes queueing), "
        "'paced' publishes at --paced-rate, by default half the median burst rate",
        "cpu": "process_time of this process (all threads, including the bench's own "
        "publisher) + RUSAGE_CHILDREN (curl) + live child processes other than the servers "
        "(decoding pools, /proc/PID/stat); server CPU apart as server_cpu_s",
        "rss": "VmHWM reset via /proc/self/clear_refs before each run; ours is compared "
        "with ring size = RING_SLOTS x PART_SIZE",
        "contention": "other_cpu_s = machine busy CPU (/proc/stat) during the run minus ours, "
        "our children's and the servers'; other_cpu_share = that / (seconds x cores)",
        "ceiling": f"{concurrency} parallel {part_mb} MiB ranges (KvikIO: {part_mb} MiB tasks); "
        "ours reads at its own part_size setting (in settings.part_size)",
        "put_raw": "the outputs' ceiling: the .npy and sidecar bytes ours writes for each "
        "object, PUT by plain threads through the sink's transport (threaded_http.put_from, "
        "presigned): multipart at the sink's part size and sink_parts_in_flight where the "
        "sink uses parts, else one PUT, on 2 x fetch_concurrency threads; its GB/s is of "
        "source bytes, as ours'",
        "scaled": "ours-hook-pN / ours-pN: `dicom-ingest worker --processes N` (the supervisor "
        "and N child workers in one group) on a fresh topic of 4 x N partitions, notifications "
        "round robin; latency = arrival of the result record at the bench's consumer "
        "(fetch_max_wait_ms=10) minus the publish time; throughput = objects / (last result "
        "- first publish); CPU = utime+stime of the supervisor's process tree (/proc/PID/stat), "
        "the bench's own apart; peak RSS = VmHWM per child (reset via clear_refs), the largest "
        "in peak_rss_bytes; warm-up, repeats and paced pass as ours",
        "plain": "the plain sequential worker (reader plain, named with --readers): one "
        "object at a time on one connection, whole GET into memory, pydicom, the Modality "
        "LUT in NumPy, float32, numpy.save, one PUT; objects pydicom cannot read are listed "
        "in failed and passed over",
        "decode": DECODE_METHOD,
    }
