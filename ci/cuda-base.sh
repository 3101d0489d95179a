#!/usr/bin/env bash
# The cuda image's base from what CI reaches: the debootstrapped Debian 12 (ci/base-image.sh), its
# compilers, and CUDA's pip wheels (CUDA_WHEELS below: headers, libcudart, nvcc, cicc) laid out as a
# CUDA_HOME at /usr/local/cuda (bin/, include/, lib64/), committed as image TAG. Then it checks,
# one line each, what the cuda recipe's build needs there (UCX's --with-cuda: cuda.h,
# cuda_runtime.h, libcudart, libcuda; NIXL's meson: the same and a working nvcc), and runs the
# installer's plan for cuda in it (README's set-up, --dry-run). It prints "cuda base: OK" or one
# "cuda base: MISSING ..." line per thing missing, and exits 0 either way: what is missing is the
# finding this step reports; a base that cannot be made at all (apt, pip, docker) fails it.
# Usage: ci/cuda-base.sh BASE_TAG TAG   (DOCKER_HOST names the daemon; PY or .venv's python runs pip)
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:?usage: ci/cuda-base.sh BASE_TAG TAG} tag=${2:?usage: ci/cuda-base.sh BASE_TAG TAG}
py=${PY:-$PWD/.venv/bin/python}
# CUDA 13.0, the runtime the cuda wheel asks pip for (installer/manylinux.toml: nvidia-cuda-runtime==13.*)
CUDA_WHEELS=("nvidia-cuda-runtime==13.0.96" "nvidia-cuda-nvcc==13.0.88" "nvidia-cuda-crt==13.0.88" "nvidia-nvvm==13.0.88"
             "nvidia-cuda-cccl==13.0.85")
wheels=_work/ci-cuda-wheels
rm -rf "$wheels" && mkdir -p "$wheels"
"$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: -d "$wheels" "${CUDA_WHEELS[@]}" 2>&1 |
  grep -v 'is ignored' >&2 || true
[ "$(ls "$wheels"/*.whl 2>/dev/null | wc -l)" = "${#CUDA_WHEELS[@]}" ] ||
  { echo "error: pip download of ${CUDA_WHEELS[*]} failed" >&2; exit 1; }
echo "cuda wheels: $(cd "$wheels" && ls | sed 's/-py3-none.*//' | tr '\n' ' ')"
ca=/etc/ssl/certs/ca-certificates.crt  # this host's bundle, with the intercepting proxy's CA
name=kvstack-cuda-base-$$
trap 'docker rm -f "$name" >/dev/null 2>&1 || true' EXIT
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | docker run -i --name "$name" --network host \
  -v "$PWD/$wheels:/cuda-wheels:ro" -v "$ca:/host-ca.crt:ro" -e PIP_CERT=/host-ca.crt \
  -e DEBIAN_FRONTEND=noninteractive "$base" bash -euo pipefail -c '
    mkdir /src && cd /src && tar -xf -
    apt-get update -qq && apt-get install -y -qq --no-install-recommends python3 python3-venv g++ make >/dev/null
    # each wheel unpacks under nvidia/cu13/ (bin, include, lib): that tree is the CUDA_HOME
    for w in /cuda-wheels/*.whl; do python3 -m zipfile -e "$w" /opt/cuda-wheels; done
    ln -s /opt/cuda-wheels/nvidia/cu13 /usr/local/cuda
    ln -s lib /usr/local/cuda/lib64
    ln -s libcudart.so.13 /usr/local/cuda/lib/libcudart.so  # the link name: the wheel has the soname only
    chmod +x /usr/local/cuda/bin/* /usr/local/cuda/nvvm/bin/* 2>/dev/null || true  # zipfile keeps no modes
    echo "CUDA_HOME /usr/local/cuda: $(ls /usr/local/cuda | tr "\n" " ")"
    missing=0
    miss() { echo "cuda base: MISSING $1"; missing=$((missing + 1)); }
    cd /tmp
    for h in cuda.h cuda_runtime.h; do
      [ -e /usr/local/cuda/include/$h ] || miss "$h (UCX --with-cuda, NIXL: the CUDA headers)"
    done
    printf "#include <cuda_runtime.h>\nint main(void) { int n; return cudaGetDeviceCount(&n) == cudaSuccess; }\n" > rt.c
    gcc rt.c -I/usr/local/cuda/include -L/usr/local/cuda/lib64 -lcudart -o rt 2>rt.err ||
      miss "libcudart.so to link (UCX --with-cuda, NIXL -lcudart): $(head -1 rt.err)"
    printf "#include <cuda.h>\nint main(void) { CUuuid u; return cuDeviceGetUuid(&u, 0); }\n" > drv.c
    if ! gcc drv.c -I/usr/local/cuda/include -L/usr/local/cuda/lib64 -L/usr/local/cuda/lib64/stubs -lcuda -o drv 2>drv.err; then
      miss "libcuda.so, the driver API link library (UCX configure: AC_CHECK_LIB cuda cuDeviceGetUuid; NIXL links -lcuda): NVIDIA ships it only with the driver or as the CUDA toolkit lib64/stubs/libcuda.so; no CUDA wheel on PyPI carries it and Debian has it only with the driver in non-free (libcuda1), which the base does not list"
    fi
    if /usr/local/cuda/bin/nvcc --version > nvcc.txt 2>&1; then
      echo "nvcc: $(grep -o "release [0-9.]*" nvcc.txt)"
      printf "__global__ void k(int *p) { *p = 1; }\n" > k.cu
      /usr/local/cuda/bin/nvcc -c k.cu -o k.o 2>k.err || miss "a working nvcc (NIXL: add_languages CUDA): $(head -1 k.err)"
    else
      miss "nvcc (NIXL: add_languages CUDA): $(head -1 nvcc.txt)"
    fi
    echo "--- the installer plan for cuda here (README set-up, --dry-run)"
    cd /src && CUDA_HOME=/usr/local/cuda bash ci/setup.sh --platform cuda --dry-run > /tmp/plan.txt && head -4 /tmp/plan.txt
    grep -o "with-cuda=[^ ]*" /tmp/plan.txt | head -1
    [ "$missing" = 0 ] && echo "cuda base: OK" || echo "cuda base: $missing missing: the cuda image cannot be built on this base"'
docker commit "$name" "$tag" >/dev/null
echo "cuda base image: $tag"
