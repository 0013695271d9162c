#!/usr/bin/env bash
# Install the carried wheels into /tmp/site (--no-deps, over the GPU image's packages), from whichever of the
# folders .whl .whl_core .whl_ds .whl_bnb is in the repo root (gpu_run.sh and gpu_dist.sh call it). A second call
# with the same wheels does nothing: two scripts in one device call install once.
set -uo pipefail
shopt -s nullglob
wheels=(.whl/*.whl .whl_core/*.whl .whl_ds/*.whl .whl_bnb/*.whl)
if [ ${#wheels[@]} = 0 ]; then
  echo "install_wheels.sh: no wheels in .whl .whl_core .whl_ds .whl_bnb: using the image's packages" >&2; exit 0
fi
SITE=${SITE:-/tmp/site}
stamp=$SITE/.installed_wheels
listing=$(printf '%s\n' "${wheels[@]##*/}" | sort -u)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$listing" ]; then exit 0; fi
# one wheel per distribution: a name in two folders installs once (the later folder's copy)
declare -A pick
for w in "${wheels[@]}"; do pick[${w##*/}]=$w; done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${pick[@]}" \
  || { echo "install_wheels.sh: pip install failed" >&2; exit 1; }
echo "$listing" > "$stamp"
echo "installed into $SITE: $(echo "$listing" | tr '\n' ' ')"
