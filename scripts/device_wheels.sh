#!/usr/bin/env bash
# Wheels (CPython 3.12, Linux x86_64) of what the device check needs beyond a stock PyTorch image (torch, transformers,
# numpy, tqdm, psutil and matplotlib there), pinned to the versions this project's CI resolves, into ./.whl:
#
#   bash scripts/device_wheels.sh
#
# On the GPU machine, from the repository root (the folder travels with the checkout, ignored by git):
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && PYTHONPATH=/tmp/site:. python3 scripts/device_check.py --out "$OUT"
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
binary=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64)
for requirement in \
  hivemind==1.1.12 prefetch_generator==1.0.3 grpcio==1.85.3 grpcio-tools==1.85.1 protobuf==7.36.2 \
  ConfigArgParse==1.9.0 py-multihash==3.0.0 py-cid==0.5.0 py-multibase==2.0.0 py-multicodec==1.0.0 morphys==1.0 \
  python-baseconv==1.2.2 varint==1.0.2 base58==2.1.1 netaddr==1.3.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 uvloop==0.23.0 msgpack==1.2.4 sortedcontainers==2.4.0; do
  # a pure-Python package published as a source archive only is built into a wheel here
  python3 -m pip download -q --no-deps "${binary[@]}" -d .whl "$requirement" 2>/dev/null \
    || python3 -m pip wheel -q --no-deps -w .whl "$requirement"
done
du -sh .whl
