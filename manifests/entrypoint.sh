#!/usr/bin/env bash
# ENTRYPOINT of the nvrx_lab image. The Job gives its script as the container's args, so this runs
# first: CUDA forward compatibility as the base image would set it up, then the args, argv intact.
#
# Why not the base image's own entrypoint: the AWS DLC's runs its CUDA compat script in a child
# shell (its LD_LIBRARY_PATH is lost) and then `eval "$@"`, which re-splits a multi-line `bash -c`
# script. Here the compat script is sourced and the args are exec'd as given.
if [[ -x /opt/nvidia/nvidia_entrypoint.sh ]]; then
  exec /opt/nvidia/nvidia_entrypoint.sh "$@"  # NGC base: its entrypoint does the compat set-up, then exec "$@"
fi
if [[ -f /usr/local/bin/start_cuda_compat.sh ]] && command -v nvidia-smi >/dev/null 2>&1; then
  # AWS DLC base: puts /usr/local/cuda/compat first on LD_LIBRARY_PATH when the node's driver is older
  # than the image's CUDA (it prints both versions: `kubectl logs` shows them).
  source /usr/local/bin/start_cuda_compat.sh
fi
exec "$@"
