#!/usr/bin/env bash
# Installs what the lab host and the controller need from Debian, once. Safe to re-run.
set -euo pipefail
if [ "$(id -u)" -ne 0 ]; then
  echo "host-deps: the lab needs root (containers, bridges, apt); run as root or with sudo" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null; then
  echo "host-deps: apt-get not found; the lab host must be Debian 12 (or a derivative)" >&2
  exit 1
fi
# e2fsprogs and fuse2fs: the unit tests' real filesystems (tests/unit/realfs.py: ext4 images, one served by FUSE).
pkgs=(lxc debootstrap iproute2 openssh-client rsync python3-venv python3-pip ca-certificates e2fsprogs fuse2fs)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "host-deps: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
