"""Shared helpers for bench/*.py: timing (GPU only; medians of triton.testing.do_bench, on random data) and
train.py runs in a subprocess."""
import os
import subprocess
import sys
import tempfile
import threading

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The H200's bf16 dense rate, for MFU = model FLOPs / time / H200_PEAK_FLOPS: the spec sheet's peak is the headline.
# The dense bf16 matmul rate measured on it (matmul_tflops(), 737..798 TFLOP/s across runs in BENCHMARKS.md) may
# stand beside it, as the rate a real kernel reaches.
H200_PEAK_FLOPS = 989e12  # NVIDIA H200 SXM spec, bf16 dense tensor cores
H200_MATMUL_FLOPS = 790e12  # measured, as above


def median_ms(fn, warmup=25, rep=100):
    """Median time of fn() in milliseconds (CUDA events, after warm-up)."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def copy_bandwidth_gbs(nbytes=2 << 30):
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written: the memory ceiling."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def matmul_tflops(n=8192, dtype=torch.bfloat16):
    """Dense n x n x n matrix product rate in TFLOP/s on random data: the arithmetic ceiling."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = median_ms(lambda: a @ b)
    return 2 * n**3 / ms / 1e9


def peak_memory_gb(fn):
    """Peak allocated memory of fn() above what was allocated before it, in GB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e9


class GpuClocks:
    """`with GpuClocks() as clocks: ...` samples the GPU's SM clock and power draw (nvidia-smi, every 100 ms, into a
    temporary file: a pipe nobody reads would fill and stall it) while the block runs; clocks.medians() and
    str(clocks) give their medians. Kernels timed alone (do_bench) run at the full clock; a whole training step can
    draw the board's power limit and run at a lower one, so the two rates differ."""

    QUERY = "clocks.sm,clocks.max.sm,power.draw,power.limit"

    def __enter__(self):
        self.samples, self.log = [], tempfile.TemporaryFile("w+")
        try:
            self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits",
                                          "-lms", "100", "-i", self.bus_id()],
                                         stdout=self.log, stderr=subprocess.DEVNULL, text=True)
        except OSError:  # no nvidia-smi: nothing to report
            self.proc = None
        return self

    @staticmethod
    def bus_id():
        """This process's GPU as nvidia-smi names it (CUDA's device numbers may be remapped)."""
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        return f"{p.pci_domain_id:08X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0"

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # stuck in the driver: don't hang the benchmark on it
                self.proc.kill()
        self.log.seek(0)
        for line in self.log:
            try:
                sample = [float(x) for x in line.split(",")]
            except ValueError:  # "[N/A]", or a line cut off by terminate()
                continue
            if len(sample) == 4:
                self.samples.append(sample)
        self.log.close()

    def medians(self):
        """(SM clock MHz, its max, power W, power limit W), medians of the samples; None when there are none."""
        if not self.samples:
            return None
        return tuple(sorted(col)[len(col) // 2] for col in zip(*self.samples))

    def __str__(self):
        if not self.samples:
            return "GPU clock: no samples (nvidia-smi missing or failing)"
        clock, max_clock, power, limit = self.medians()
        return (f"GPU over {len(self.samples)} samples: SM clock median {clock:,.0f} MHz (max {max_clock:,.0f}), "
                f"power median {power:,.0f} W (limit {limit:,.0f} W)")


def try_import_liger():
    """Liger-Kernel's module, or None with a printed reason (it is optional and not in requirements)."""
    try:
        import liger_kernel  # noqa: F401
        return liger_kernel
    except Exception as e:  # ImportError, or a version clash with the installed triton
        print(f"[skip] Liger-Kernel not available ({type(e).__name__}: {e})")
        return None


def run_train(args, log_path, until=None, timeout=300, launcher=("train.py",)):
    """`python train.py args` in the repo root (or `python *launcher args`), its output copied to log_path as it
    comes; killed at the first output line starting with `until`, or after timeout seconds. Its output lines."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    proc = subprocess.Popen([sys.executable, *launcher, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    lines = []
    with open(log_path, "w") as log:
        for line in proc.stdout:
            lines.append(line.rstrip())
            log.write(line)
            if until and line.startswith(until):
                proc.kill()
    proc.wait()
    watchdog.cancel()
    return lines
