import subprocess
import sys
import textwrap

import pytest

# In its own process: the heap settings are process-wide.
FREED_HEAP = textwrap.dedent("""
    import os, torch
    from specgate.runtime import keep_freed_memory, release_freed_memory

    def rss_mb():
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    assert keep_freed_memory()
    blocks = [torch.ones(32768 + 64 * (i % 7)) for i in range(3000)]  # ~400 MB in the heap, sizes varying
    keep = blocks[::50]
    del blocks
    held = rss_mb()
    assert release_freed_memory()
    print(held, rss_mb(), len(keep))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
def test_freed_heap_pages_go_back_to_the_os_and_kept_blocks_stay():
    out = subprocess.run([sys.executable, "-c", FREED_HEAP], capture_output=True, text=True, check=True).stdout.split()
    held, after, kept = float(out[0]), float(out[1]), int(out[2])
    assert kept == 60 and held - after > 250, (held, after)  # keep_freed_memory alone would hold all of it


LARGE_BLOCKS = textwrap.dedent("""
    import os, sys, torch
    from specgate.runtime import keep_freed_memory

    def rss_mb():
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    assert keep_freed_memory(mmap_above=int(sys.argv[1]) << 20)
    before = rss_mb()
    block = torch.ones(16 * 2**20)  # 64 MiB, touched
    del block
    print(rss_mb() - before)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
def test_blocks_above_the_mmap_threshold_go_back_when_freed_and_smaller_ones_stay():
    def held_after_free(mmap_above_mb: int) -> float:
        cmd = [sys.executable, "-c", LARGE_BLOCKS, str(mmap_above_mb)]
        return float(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)

    assert held_after_free(16) < 8  # its own mmap, unmapped by free
    assert held_after_free(1024) > 56  # kept in the heap for the next step
