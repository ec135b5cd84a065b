"""What a video job costs beyond its DiT: the MP4 and the job store.

1. ``videos.encode_mp4`` (H.264, CRF 18, PyAV's libx264) of a clip of Wan2.2-TI2V-5B's size
   (121 frames of 832x480, 5 s at 24 fps), and of a 1280x704 one: seconds, and the MP4's
   size. Random frames are the worst case for an encoder; a smooth gradient that moves is
   closer to a generated clip.
2. A job's store calls as a router makes them (create, claim, three progress writes,
   put_content of the MP4, the final update, get_content), on the embedded SQLite store
   and, where ``redis-server`` is on PATH, on a Redis started here: milliseconds per job.

    .venv/bin/python bench/video_jobs.py [--jobs 50]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from _load import free_port, markdown_table
from omni_runtime.router.job_store import JobStore, RedisJobStore, SqliteJobStore, VideoJob
from omni_runtime.router.video_jobs import new_job_id
from omni_runtime.videos import encode_mp4


def moving_gradient(frames: int, height: int, width: int) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width]
    clip = np.empty((frames, height, width, 3), dtype=np.uint8)
    for t in range(frames):
        clip[t, ..., 0] = (x + 4 * t) % 256
        clip[t, ..., 1] = (y + 2 * t) % 256
        clip[t, ..., 2] = ((x + y) // 2 + t) % 256
    return clip


def encode_table() -> str:
    rows: list[list[object]] = []
    rng = np.random.default_rng(0)
    for height, width in ((480, 832), (704, 1280)):
        for kind, clip in (
            ("moving gradient", moving_gradient(121, height, width)),
            ("random", rng.integers(0, 256, (121, height, width, 3), dtype=np.uint8)),
        ):
            start = time.perf_counter()
            data = encode_mp4(clip, 24)
            seconds = time.perf_counter() - start
            rows.append([f"{width}x{height}", kind, f"{seconds:.2f}", f"{len(data) / 2**20:.1f}"])
    return markdown_table(["size", "frames", "encode s (121 frames)", "MP4 MiB"], rows)


async def one_job(store: JobStore, owner: str, video: bytes) -> float:
    start = time.perf_counter()
    now = time.time()
    job = VideoJob(
        id=new_job_id(now),
        created_at=int(now),
        status="queued",
        model="bench",
        prompt="a fox",
        size="832x480",
        seconds="5",
        params={"num_frames": 121, "fps": 24},
    )
    await store.create(job, max_active=10**6)
    claimed = await store.claim(owner, now=time.time(), lease_s=15, max_attempts=2)
    assert claimed is not None
    for progress in (25, 50, 75):
        await store.update(claimed.id, owner=owner, progress=progress)
    await store.put_content(claimed.id, video)
    await store.update(claimed.id, owner=owner, status="completed", progress=100)
    assert await store.get_content(claimed.id) is not None
    return (time.perf_counter() - start) * 1e3


async def store_rows(name: str, store: JobStore, jobs: int, video: bytes) -> list[object]:
    times = [await one_job(store, "bench", video) for _ in range(jobs)]
    await store.close()
    median, most = statistics.median(times), max(times)
    return [name, f"{len(video) / 2**20:.1f}", f"{median:.1f}", f"{most:.1f}"]


async def store_table(jobs: int) -> str:
    video = encode_mp4(moving_gradient(121, 480, 832), 24)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows.append(await store_rows("SQLite", SqliteJobStore(Path(tmp)), jobs, video))
        server = shutil.which("redis-server")
        if server is not None:
            port = free_port()
            proc = subprocess.Popen(
                [server, "--port", str(port), "--save", "", "--appendonly", "no"],
                cwd=tmp,
                stdout=subprocess.DEVNULL,
            )
            try:
                store = RedisJobStore(f"redis://127.0.0.1:{port}/0", prefix="bench")
                deadline = time.monotonic() + 10
                while True:
                    try:
                        await store.ping()
                        break
                    except Exception:
                        if time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.05)
                rows.append(await store_rows("Redis", store, jobs, video))
            finally:
                proc.terminate()
                proc.wait()
    return markdown_table(["store", "MP4 MiB", "ms per job (median)", "max ms"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=50)
    args = parser.parse_args()
    print("MP4 encoding, 121 frames at 24 fps:\n")
    print(encode_table())
    print(f"\nA job's store calls ({args.jobs} jobs, one at a time):\n")
    print(asyncio.run(store_table(args.jobs)))


if __name__ == "__main__":
    main()
