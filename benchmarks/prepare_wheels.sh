#!/usr/bin/env bash
# Download, for the GPU machine, the wheels its image lacks: Python 3.12, manylinux x86_64, no deps.
#
# Why pinned lists and --no-deps: the GPU image already holds torch 2.11, transformers 5.17, peft,
# accelerate, numpy, rich, httpx ... (the package list in the device notes, read 2026-11-17); letting pip
# resolve would fetch torch and the CUDA wheels again (gigabytes). The lists below are what
# `pip install --dry-run --report` resolved for prefect 3.8.8 + fastapi<0.151 + gguf on Python 3.12
# (2026-11), minus the packages the image already has; plus typing-extensions, because pydantic 2.14
# needs >= 4.14.1 and the image's version is not recorded.
#
# Why two folders: the device tool carries at most 64 MiB per call (working tree included).
#   .whl/          bitsandbytes (trimmed), prefect + its missing deps, gguf, pydantic, liger-kernel
#   .whl-unsloth/  unsloth (trimmed), unsloth_zoo, trl, datasets and their missing deps; needs .whl too
#   .whl-ray/      (--ray) ray 2.60.0 trimmed and recompressed for train.cluster, and tensorboardX; needs .whl too
# All folders must be git-ignored, or they travel as untracked files on every device call.
#
# Usage: bash benchmarks/prepare_wheels.sh [--no-unsloth] [--ray | --ray-only]
#   --ray       also write RAY_WHEELS_DIR; --ray-only writes only that folder
#   RAY_TAR=1   RAY_WHEELS_DIR holds ray-site.tar.xz instead of wheels: both installed for CPython $PY_TAG (17.0 MiB
#               against 25.0 MiB of wheels; .whl + the wheels exceed what a call carries). On the device:
#               mkdir -p /tmp/ray-site && tar -xJf .whl-ray/ray-site.tar.xz -C /tmp/ray-site, then PYTHONPATH
#   env: WHEELS_DIR (default .whl), UNSLOTH_WHEELS_DIR (default .whl-unsloth), RAY_WHEELS_DIR (default .whl-ray),
#        PYTHON (default python3), PY_TAG (default 312: the device's CPython; 311 fetches this machine's, to test)
set -euo pipefail

cd "$(dirname "$0")/.."
WHEELS_DIR=${WHEELS_DIR:-.whl}
UNSLOTH_WHEELS_DIR=${UNSLOTH_WHEELS_DIR:-.whl-unsloth}
RAY_WHEELS_DIR=${RAY_WHEELS_DIR:-.whl-ray}
PYTHON=${PYTHON:-python3}
PY_TAG=${PY_TAG:-312}
WITH_BASE=1 WITH_UNSLOTH=1 WITH_RAY=0
for arg in "$@"; do
  case $arg in
    --no-unsloth) WITH_UNSLOTH=0 ;;
    --ray) WITH_RAY=1 ;;
    --ray-only) WITH_RAY=1 WITH_BASE=0 WITH_UNSLOTH=0 ;;
    *) echo "prepare_wheels: unknown argument $arg" >&2; exit 2 ;;
  esac
done

# The tags the GPU machine's pip accepts for CPython 3.12 on x86_64 (glibc 2.39); pip matches each exactly.
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64)

BASE_PKGS=(
  bitsandbytes==0.50.2 liger-kernel==0.8.5 gguf==0.19.0 nvidia-ml-py==13.615.71
  prefect==3.8.8 fastapi==0.150.0 typing-extensions==4.16.0
  pydantic==2.14.3 pydantic-core==2.50.4 pydantic-extra-types==2.11.1 pydantic-settings==2.16.3
  annotated-types==0.8.0 typing-inspection==0.4.5
  aiosqlite==0.22.1 alembic==1.20.1 mako==1.4.3 sqlalchemy==2.0.58 greenlet==3.5.6 asyncpg==0.32.0
  amplitude-analytics==1.3.0 apprise==1.13.1 requests-oauthlib==2.0.0 oauthlib==4.0.1
  asgi-lifespan==2.1.0 starlette==1.10.0 uvicorn==0.54.0 websockets==16.1.1 sniffio==1.3.1
  h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0
  cachetools==7.3.2 coolname==5.0.0 dateparser==1.5.0 pytz==2026.6 tzdata==2026.6 tzlocal==5.4.5
  pendulum==3.3.0 docker==7.2.0 griffe==2.4.1 griffecli==2.4.1 griffelib==2.4.1
  jsonpatch==1.47 jsonpointer==3.12 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
  referencing==0.37.0 rpds-py==2026.9.1 rfc3339-validator==0.1.4
  opentelemetry-api==1.45.2 orjson==3.13.0 python-slugify==9.0.0 text-unidecode==1.3 readchar==4.2.2
  cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
  cyclopts==5.4.0 docstring-parser==0.18.0 rich-rst==2.2.0 exceptiongroup==1.3.1 graphviz==0.21
  jinja2-humanize-extension==0.4.0 pydocket==0.27.0 burner-redis==0.1.7 cronsim==2.8
  py-key-value-aio==0.4.6 beartype==0.23.1 python-dotenv==1.2.4 python-json-logger==4.2.0 redis==8.1.0
  ruamel-yaml==0.19.1 ruamel-yaml-clib==0.2.15 semver==3.1.1 toml==0.10.2 uncalled-for==0.6.1
)
# unsloth 2026.10.9 pins transformers<=5.17.0 and trl<=1.15.0 (the image has transformers 5.17.0);
# datasets <5 and not 4.0/4.1.0/4.4/4.5.0; datasets wants dill<0.4.2 and multiprocess<0.70.20.
# Left out on purpose (imports are guarded in unsloth): xformers, torchao, diffusers, hf_transfer.
UNSLOTH_PKGS=(
  unsloth==2026.10.9 unsloth-zoo==2026.10.9 trl==1.15.0 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19
  cut-cross-entropy==25.1.1 tyro==1.0.17 typeguard==4.6.0 msgspec==0.22.0 nest-asyncio==1.6.0
)
# ray[train] 2.60.0 (the lock's pin) for train.cluster. Of its Requires-Dist (click, filelock, jsonschema, msgpack,
# packaging, protobuf, pyyaml, requests; train extra: pandas, tensorboardX, pyarrow, fsspec, pydantic) the image
# has all but jsonschema (in .whl, with referencing, rpds-py, jsonschema-specifications; attrs is in the image),
# pydantic (in .whl) and tensorboardX (here; only Tune's TensorBoard logger imports it). Not the "default" extra:
# train.cluster starts Ray with include_dashboard=False.
RAY_PKGS=(ray==2.60.0 tensorboardX==2.6.5)

_download() {  # _download DIR PKG...
  local dir=$1; shift
  local args=(--no-deps --only-binary=:all: --python-version "3.${PY_TAG#3}" --implementation cp --abi "cp$PY_TAG"
              --abi abi3 --abi none -d "$dir")
  for p in "${PLATFORMS[@]}" any; do args+=(--platform "$p"); done
  mkdir -p "$dir"
  "$PYTHON" -m pip download -q "${args[@]}" "$@" 2>&1 | grep -v "^WARNING: Location" || true
  for p in "$@"; do  # pip's exit status is hidden by the filter above: check each pin arrived
    local stem=${p%%==*}; stem=${stem//-/_}
    if ! compgen -G "$dir/${stem}-${p##*==}-*.whl" >/dev/null && ! compgen -G "$dir/${stem,,}-${p##*==}-*.whl" >/dev/null; then
      echo "prepare_wheels: $p did not download into $dir; check the pin and the platform tags" >&2
      exit 1
    fi
  done
}

_trim() {  # _trim WHEEL REGEX: drop members matching REGEX from the wheel and from its RECORD
  "$PYTHON" - "$1" "$2" <<'EOF'
import os, re, sys, zipfile

path, pattern = sys.argv[1], re.compile(sys.argv[2])
tmp = path + ".tmp"
dropped = 0
with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
    for info in src.infolist():
        if pattern.search(info.filename):
            dropped += 1
            continue
        data = src.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            # pip rewrites RECORD on install; a line for a missing file would make uninstall fail.
            lines = data.decode().splitlines(keepends=True)
            data = "".join(l for l in lines if not pattern.search(l.split(",", 1)[0])).encode()
        dst.writestr(info, data)
os.replace(tmp, path)
print(f"trimmed {os.path.basename(path)}: dropped {dropped} files, now {os.path.getsize(path) / 2**20:.1f} MiB")
EOF
}

_slim() {  # _slim WHEEL REGEX: rebuild WHEEL without members matching REGEX, ELF files stripped, LZMA-compressed
  "$PYTHON" - "$1" "$2" <<'EOF'
import base64, hashlib, os, re, shutil, subprocess, sys, tempfile, zipfile

path, pattern = sys.argv[1], re.compile(sys.argv[2])
strip = shutil.which("strip")
tmp = path + ".tmp"
kept, new_hash = [], {}
with zipfile.ZipFile(path) as src:
    for info in src.infolist():
        if pattern.search(info.filename):
            continue
        data = src.read(info)
        # Debug symbols are a third of ray's three binaries (raylet, gcs_server, _raylet.so: 119 MB -> 84 MB);
        # --strip-unneeded keeps the dynamic symbols that loading and linking use. A crash's stack trace loses names.
        if strip and data[:4] == b"\x7fELF":
            with tempfile.NamedTemporaryFile(delete=False) as f:
                f.write(data)
            subprocess.run([strip, "--strip-unneeded", f.name], check=True)
            with open(f.name, "rb") as f:
                data = f.read()
            os.unlink(f.name)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            new_hash[info.filename] = f"sha256={digest},{len(data)}"
        kept.append((info, data))
with zipfile.ZipFile(tmp, "w") as dst:
    for info, data in kept:
        if info.filename.endswith(".dist-info/RECORD"):
            # pip checks no hash on install but rewrites RECORD; a line for a missing file would make uninstall fail.
            lines = []
            for line in data.decode().splitlines(keepends=True):
                name = line.split(",", 1)[0]
                if not pattern.search(name):
                    lines.append(f"{name},{new_hash[name]}\n" if name in new_hash else line)
            data = "".join(lines).encode()
        # LZMA members: pip unpacks wheels with zipfile, which reads them, and the binaries shrink by a further
        # 30% over deflate. Not for an index: other installers may accept only deflate.
        info.compress_type = zipfile.ZIP_LZMA
        dst.writestr(info, data)
os.replace(tmp, path)
print(f"slimmed {os.path.basename(path)}: kept {len(kept)} files ({len(new_hash)} ELF stripped), "
      f"now {os.path.getsize(path) / 2**20:.1f} MiB")
EOF
}

_check_ignored() {  # a wheel folder inside the repo must be git-ignored, or it travels on every call
  local dir=$1
  [[ $dir == /* ]] && return 0  # an absolute path is taken to be outside the repo
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1 && ! git check-ignore -q "$dir/x.whl"; then
    echo "prepare_wheels: $dir is not git-ignored; add '/$dir/' to .gitignore first (it would travel with" \
         "every device call and count against the 64 MiB limit)" >&2
    exit 1
  fi
}

_size() { du -sb "$1" | awk '{printf "%.1f MiB", $1 / 1048576}'; }

[[ $WITH_BASE == 1 ]] && _check_ignored "$WHEELS_DIR"
[[ $WITH_UNSLOTH == 1 ]] && _check_ignored "$UNSLOTH_WHEELS_DIR"
[[ $WITH_RAY == 1 ]] && _check_ignored "$RAY_WHEELS_DIR"
if [[ $WITH_BASE == 1 ]]; then
  rm -rf "$WHEELS_DIR" && _download "$WHEELS_DIR" "${BASE_PKGS[@]}"
  # bitsandbytes ships one 4-26 MB library per CUDA/ROCm/XPU version (43 MB wheel); the GPU image's torch is
  # cu130, so keep libbitsandbytes_cuda130.so and the CPU library: the wheel drops to about 4 MB.
  _trim "$WHEELS_DIR"/bitsandbytes-0.50.2-*.whl 'libbitsandbytes_(cuda(?!130)\d+|rocm\d+|xpu\d+)\.so$'
  echo "$WHEELS_DIR: $(ls "$WHEELS_DIR"/*.whl | wc -l) wheels, $(_size "$WHEELS_DIR")"
fi

if [[ $WITH_UNSLOTH == 1 ]]; then
  rm -rf "$UNSLOTH_WHEELS_DIR" && _download "$UNSLOTH_WHEELS_DIR" "${UNSLOTH_PKGS[@]}"
  # unsloth's 28.6 MB wheel is mostly `studio/` (a web UI: 2034 files); the training code never imports it.
  _trim "$UNSLOTH_WHEELS_DIR"/unsloth-2026.10.9-*.whl '^studio/'
  echo "$UNSLOTH_WHEELS_DIR: $(ls "$UNSLOTH_WHEELS_DIR"/*.whl | wc -l) wheels, $(_size "$UNSLOTH_WHEELS_DIR")"
fi

if [[ $WITH_RAY == 1 ]]; then
  rm -rf "$RAY_WHEELS_DIR" && _download "$RAY_WHEELS_DIR" "${RAY_PKGS[@]}"
  # ray's 76 MB wheel: Java (jars/, 31 MB), RLlib, Serve, Ray LLM, the dashboard's built web client and the
  # examples go; a TorchTrainer on one host imports none of them. What stays is mostly raylet, gcs_server and
  # _raylet.so, stripped and LZMA-compressed (_slim).
  _slim "$RAY_WHEELS_DIR"/ray-2.60.0-*.whl \
    '^ray/(jars|rllib|serve|llm|dashboard/client)/|^ray/[^/]+/(.+/)?(examples|benchmarks?|tests?|testing)/'
  echo "$RAY_WHEELS_DIR: $(ls "$RAY_WHEELS_DIR"/*.whl | wc -l) wheels, $(_size "$RAY_WHEELS_DIR")"
  if [[ ${RAY_TAR:-0} == 1 ]]; then
    # One xz stream over the installed tree compresses what raylet, gcs_server and _raylet.so share (statically
    # linked code), which per-file compression in a wheel cannot. The scripts in bin/ are left out: their
    # shebang names this machine's python, and Ray starts its processes with sys.executable.
    site=$(mktemp -d)
    targs=(--no-deps --only-binary=:all: --python-version "3.${PY_TAG#3}" --implementation cp --abi "cp$PY_TAG"
           --abi abi3 --abi none --platform manylinux2014_x86_64 --platform any --target "$site")
    "$PYTHON" -m pip install -q "${targs[@]}" "$RAY_WHEELS_DIR"/*.whl 2>&1 | grep -v "^WARNING: Location" || true
    [[ -d $site/ray ]] || { echo "prepare_wheels: ray did not install into $site" >&2; exit 1; }
    tar -C "$site" --exclude=__pycache__ --exclude=./bin -c . | xz -9e -T0 >"$RAY_WHEELS_DIR/ray-site.tar.xz"
    rm -rf "$site" "$RAY_WHEELS_DIR"/*.whl
    echo "$RAY_WHEELS_DIR: ray-site.tar.xz, $(_size "$RAY_WHEELS_DIR")"
  fi
fi

# The device tool refuses a call whose working tree plus carried folders exceed 64 MiB. .whl goes with either
# extra folder, never with both (a train.cluster run does not use unsloth).
extras=()
[[ $WITH_UNSLOTH == 1 ]] && extras+=("$UNSLOTH_WHEELS_DIR")
[[ $WITH_RAY == 1 ]] && extras+=("$RAY_WHEELS_DIR")
for extra in "${extras[@]}"; do
  [[ -d $WHEELS_DIR ]] || break
  total=$(du -scb "$WHEELS_DIR" "$extra" | tail -1 | cut -f1)
  echo "$WHEELS_DIR + $extra: $((total / 1048576)) MiB of the 64 MiB a device call may carry (working tree included)"
  if (( total > 60 * 1048576 )); then
    echo "prepare_wheels: over 60 MiB; carry $WHEELS_DIR and $extra in separate calls" \
         "$([[ $extra == "$RAY_WHEELS_DIR" ]] && echo "(or rerun with RAY_TAR=1)")" >&2
  fi
done
