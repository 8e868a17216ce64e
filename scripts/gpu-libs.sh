# Sourced by scripts/gpu-check.sh and scripts/gpu-profile.sh on the GPU machine:
# finds the CUDA libraries (pip wheels put them under site-packages/nvidia/) and
# puts their folders on LD_LIBRARY_PATH. Needs $OUTDIR and a `say` function.
# --- libraries: cudarc loads libcuda.so.1, libnvrtc.so.13, libcublasLt.so.13 and
# libnccl.so (or .so.13/.12/.../.1, never .so.2, which is what NCCL ships).
LIBDIR=$(mktemp -d /tmp/meshplan-libs.XXXXXX)
# One pass over the file system (pip wheels put these under site-packages/nvidia/).
find / -xdev \( -path /proc -o -path /sys \) -prune -o \( -name 'libnvrtc.so*' -o \
    -name 'libcublasLt.so*' -o -name 'libnccl.so*' -o -name 'libcuda.so*' \) -print \
    2>/dev/null >"$OUTDIR/libraries.txt"
paths=()
# The CUDA 13 names first (the `cuda` feature), then whatever else there is.
for pat in 'libnvrtc.so.13' 'libcublasLt.so.13' 'libnccl.so.2' 'libcuda.so.1' \
    'libnvrtc.so.12' 'libcublasLt.so.12'; do
    f=$(grep -m1 "/$pat\$" "$OUTDIR/libraries.txt" || true)
    if [ -n "$f" ]; then
        say "found $pat: $f"
        d=$(dirname "$f")
        case " ${paths[*]-} " in *" $d "*) ;; *) paths+=("$d") ;; esac
    else
        say "not found: $pat"
    fi
done
nccl=$(grep -m1 '/libnccl.so.2$' "$OUTDIR/libraries.txt" || true)
if [ -n "$nccl" ]; then
    ln -sf "$nccl" "$LIBDIR/libnccl.so"
    say "linked $LIBDIR/libnccl.so -> $nccl (cudarc does not look for libnccl.so.2)"
fi
LD=$LIBDIR
for p in "${paths[@]-}"; do [ -n "$p" ] && LD="$LD:$p"; done
export LD_LIBRARY_PATH="$LD${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
say "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
