#!/usr/bin/env bash
# ENTRYPOINT of the nvrx_lab image. The Job gives its script as the container's args, so this runs
# first: CUDA forward compatibility, then the args, exec'd as given (argv intact: never `eval`, which
# would re-split a multi-line `bash -c` script).
#
# Forward compatibility: the image's CUDA (13.0, torch's wheel) needs a driver at least as new as the
# one its compat libraries come from (/usr/local/cuda/compat/libcuda.so.<version>). When the node's
# driver is older, the compat libraries go first on LD_LIBRARY_PATH, so the container's libcuda is
# theirs; when it is as new or newer, the node's own is used. One "cuda-compat:" line says which.
# NVRX_CUDA_COMPAT_DIR overrides the folder (tests).
compat="${NVRX_CUDA_COMPAT_DIR:-/usr/local/cuda/compat}"
if [[ -d "${compat}" ]] && command -v nvidia-smi >/dev/null 2>&1; then
  node_driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 | tr -d '[:space:]')
  compat_lib=$(ls "${compat}"/libcuda.so.*.* 2>/dev/null | head -n 1)
  compat_driver="${compat_lib##*/libcuda.so.}"
  if [[ -z "${node_driver}" || -z "${compat_lib}" ]]; then
    echo "cuda-compat: not used (node driver '${node_driver:-unknown}', compat libraries '${compat_lib:-none}')"
  elif [[ "$(printf '%s\n%s\n' "${node_driver}" "${compat_driver}" | sort -V | head -n 1)" != "${compat_driver}" ]]; then
    export LD_LIBRARY_PATH="${compat}${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
    echo "cuda-compat: node driver ${node_driver} is older than the image's CUDA (${compat_driver}): using ${compat}"
  else
    echo "cuda-compat: node driver ${node_driver} runs the image's CUDA (${compat_driver}) natively"
  fi
fi
exec "$@"
