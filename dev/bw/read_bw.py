"""Attainable DRAM bandwidth on the device, by torch (a reference, never in q4moe's decode):
a read-only reduction against a device-to-device copy, over buffers much larger than L2.
q4moe's bench reports its `copy_bandwidth_gb_s` as a copy's read + write bytes; this says how
much a kernel that only reads can get, i.e. the ceiling for the weight-streaming kernels.
    python3 dev/bw/read_bw.py [MiB, default 1024]"""
import sys
import torch

mib = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
n = mib << 20
a = torch.randint(0, 1 << 30, (n // 4,), dtype=torch.int32, device="cuda")
b = torch.empty_like(a)


def timed(f, reps=20):
    f()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        s.record()
        for _ in range(reps):
            f()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / reps * 1e-3)
    times.sort()
    return times[len(times) // 2], times[0], times[-1]


def report(name, bytes_moved, t):
    med, lo, hi = t
    print(f"{name}: {bytes_moved / med / 1e9:.0f} GB/s (median of 5; {bytes_moved / hi / 1e9:.0f}-{bytes_moved / lo / 1e9:.0f}), {med * 1e6:.1f} us")


# A max, not a sum: an int32 sum to int64 is bound by its conversions (767 GB/s on the H200).
report("copy (read + write bytes)", 2 * n, timed(lambda: b.copy_(a)))
report("read: int32 max", n, timed(lambda: a.max()))
h = a[: (272 << 20) // 4]
report("read 272 MiB (the Q4_K_M head's bytes): int32 max", h.numel() * 4, timed(lambda: h.max(), 50))
print(torch.cuda.get_device_name(), f"{mib} MiB")
