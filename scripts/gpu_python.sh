# The Python of a GPU machine without network, for the one-command GPU calls
# (examples/ted/gl-en-2x2-gpu/run.sh, benchmarks/gpu_call.sh). Sourced after examples/common.sh
# (log, die, ROOT); both functions keep what they make under $WORK.
#   use_python       `python` on PATH is the interpreter that imports torch
#   install_missing  fairseq from the carried wheels (.whl/, scripts/gpu_wheels.sh) and this project,
#                    when fairseq does not import

# `python` must be the interpreter that holds torch (a machine may name it python3 only).
use_python() {
    mkdir -p "$WORK/.bin"
    python -c 'import torch' 2> /dev/null && return
    local py shim=$WORK/.bin
    py=$(python3 -c 'import sys, torch; print(sys.executable)') || die "neither python nor python3 on PATH imports torch"
    printf '#!/bin/sh\nexec %q "$@"\n' "$py" > "$shim/python"
    chmod +x "$shim/python"
    export PATH="$shim:$PATH"
    log "python: $py (python3 on PATH)"
}

# fairseq from the carried wheels, and this project, into the interpreter's own environment (where
# the tests look for fairseq-train); a read-only environment gets them under a folder of its own.
install_missing() {
    python -c 'import fairseq' 2> /dev/null && return
    local wheels=$ROOT/.whl purelib site
    ls "$wheels"/*.whl > /dev/null 2>&1 || die "fairseq is not installed and $wheels holds no wheels (run scripts/gpu_wheels.sh and carry .whl)"
    log "install: $(ls "$wheels"/*.whl | wc -l) wheels from .whl, and this project"
    pip_install() { python -m pip install -q --disable-pip-version-check --no-index --no-deps --no-cache-dir "$@"; }
    purelib=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    if [ -w "$purelib" ]; then
        pip_install --no-compile "$wheels"/*.whl || die "pip could not install the wheels of $wheels (above)"
        pip_install --no-build-isolation "$ROOT" || die "pip could not install this project (above)"
    else
        site=$WORK/.site
        pip_install --no-compile --upgrade --target "$site" "$wheels"/*.whl || die "pip could not install the wheels of $wheels (above)"
        pip_install --no-build-isolation --upgrade --target "$site" "$ROOT" || die "pip could not install this project (above)"
        export PYTHONPATH="$site:$PYTHONPATH" PATH="$site/bin:$PATH"
    fi
    python -c 'import fairseq' || die "fairseq still does not import after installing the wheels"
    PATH="$(python -c 'import sysconfig; print(sysconfig.get_paths()["scripts"])'):$PATH"  # fairseq-train, ...
    log "install: done, fairseq $(python -c 'import fairseq; print(fairseq.__version__)')"
}
