#!/usr/bin/env bash
# linattn on 64-bit ARM Linux (Graviton, Ampere, a Raspberry Pi 4 or 5), emulated on an x86-64 machine with
# qemu-user: a Debian arm64 root, pip's NumPy, SciPy and Numba for aarch64, this working tree installed, then
# tools/arm64_smoke.py on Numba's workqueue layer (no libgomp) and on its omp layer (with libgomp: OpenBLAS
# shares linattn's pool). Needs root and Debian's qemu-user-static and debootstrap. Compiling under emulation
# takes minutes: about 10 minutes with a new root, one once it exists (its kernels cached).
#     sudo bash tools/arm64_check.sh [root directory, default /tmp/linattn-arm64]
set -euo pipefail
root=${1:-/tmp/linattn-arm64}
cd "$(dirname "$0")/.."
command -v qemu-aarch64-static > /dev/null && command -v debootstrap > /dev/null \
  || apt-get install -y -q qemu-user-static debootstrap > /dev/null
if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then  # run aarch64 programs through qemu (F: inside a chroot too)
  mountpoint -q /proc/sys/fs/binfmt_misc || mount binfmt_misc -t binfmt_misc /proc/sys/fs/binfmt_misc
  echo ':qemu-aarch64:M::\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:/usr/bin/qemu-aarch64-static:F' \
    > /proc/sys/fs/binfmt_misc/register
fi
if [ ! -x "$root/opt/venv/bin/python" ]; then
  debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" \
    http://deb.debian.org/debian > /dev/null
  cp /etc/resolv.conf "$root/etc/resolv.conf"
  cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"  # (a proxy's own CA, if any)
  chroot "$root" python3 -m venv /opt/venv
  chroot "$root" env PIP_CERT=/etc/ssl/certs/ca-certificates.crt /opt/venv/bin/pip install -q numpy numba scipy \
    threadpoolctl
fi
rm -rf "$root/opt/linattn" && mkdir -p "$root/opt/linattn"
git ls-files -z | xargs -0 tar -c | tar -x -C "$root/opt/linattn"
chroot "$root" /opt/venv/bin/pip install -q --no-deps /opt/linattn
mountpoint -q "$root/proc" || { mount -t proc proc "$root/proc"; trap 'umount "$root/proc"' EXIT; }
chroot "$root" dpkg -r --force-depends libgomp1 > /dev/null 2>&1 || true
echo "== workqueue layer (no libgomp)"
chroot "$root" env NUMBA_CACHE_DIR=/opt/cache /opt/venv/bin/python /opt/linattn/tools/arm64_smoke.py
chroot "$root" apt-get install -y -q libgomp1 > /dev/null 2>&1
echo "== omp layer (libgomp)"
chroot "$root" env NUMBA_CACHE_DIR=/opt/cache /opt/venv/bin/python /opt/linattn/tools/arm64_smoke.py
