"""Put then get one large object through ``mailbox_from_url(URL)`` in this process, and print
the extra peak memory of each as JSON: ``python large_object.py URL BYTES``.

Run as its own process so that nothing else (a test's in-process store, earlier tests) sits in
its memory. Peak RSS is the kernel's high-water mark (VmHWM), reset before each step through
``/proc/self/clear_refs``; extra = that peak less the resident size just before the step, in
which the payload itself already sits.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from gradientmail import mailbox_from_url


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets VmHWM to the current resident size
    return _status("VmRSS")


async def main(url: str, size: int, *, keep: bool = False) -> dict[str, float]:
    mailbox = mailbox_from_url(url)
    payload = b"\x5a" * size  # written, so resident before anything is measured
    key = "large/payload"
    before = _reset_peak()
    started = time.perf_counter()
    await mailbox.put(key, payload)
    put = {"put_extra": (_status("VmHWM") - before) / size, "put_s": time.perf_counter() - started}
    before = _reset_peak()
    started = time.perf_counter()
    data = await mailbox.get(key)
    got = {"get_extra": (_status("VmHWM") - before) / size, "get_s": time.perf_counter() - started}
    assert data is not None and len(data) == size and data == payload, "the payload came back"
    if not keep:
        await mailbox.delete(key)
    return {**put, **got}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], int(sys.argv[2])))), flush=True)
