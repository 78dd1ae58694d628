#!/bin/sh
# CUDA forward compatibility: a data-centre GPU (H100, H200, A100, ...) whose host driver is on the 535 or 570
# branch runs this image's CUDA 13.0 through NVIDIA's compat libraries (cuda-compat-13-0, in
# /usr/local/cuda/compat). They must come first on the loader's path before any process starts, and only on
# those branches: on a driver >= 580 CUDA 13 needs none, and the compat package refuses newer drivers.
# NVIDIA container toolkit >= 1.17.5 may already have done this; doing it again is harmless.
# (The two paths can be moved for the image's tests.)
version_file=${LOGRA_NVIDIA_VERSION_FILE:-/proc/driver/nvidia/version}
compat=${LOGRA_CUDA_COMPAT:-/usr/local/cuda/compat}
driver=$(sed -n 's/.*Kernel Module[^0-9]*\([0-9][0-9]*\)\..*/\1/p' "$version_file" 2>/dev/null | head -n 1)
case "$driver" in
  535|570|571|572|573|574|575|576|577|578|579)
    if [ -d "$compat" ]; then
      export LD_LIBRARY_PATH="$compat${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      echo "[logra-rl image] host driver branch $driver: CUDA 13.0 through NVIDIA's forward-compatibility libraries" >&2
    fi
    ;;
esac
exec "$@"
