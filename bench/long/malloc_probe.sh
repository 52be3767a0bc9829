#!/usr/bin/env bash
# What glibc's allocator holds in a running job: attaches gdb to PID and writes
# malloc_info()'s XML (64-bit sizes; free chunks per arena, mmapped blocks) to FILE.
# The process stops for about 12 s while gdb attaches. malloc_stats() (its totals are
# 32-bit and wrap past 4 GiB) was called the same way at fixed times after the start:
#   gdb -p PID -batch -ex 'call (void)malloc_stats()' -ex detach
#   bench/long/malloc_probe.sh PID FILE
pid=$1 f=$2
timeout 60 gdb -p "$pid" -batch \
  -ex "set \$f = (void*)fopen(\"$f\", \"w\")" \
  -ex 'call (int)malloc_info(0, $f)' \
  -ex 'call (int)fclose($f)' -ex detach >/dev/null 2>&1
echo "rc=$?"
