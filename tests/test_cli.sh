#!/usr/bin/env bash
# test_cli.sh - the comet tool's command line, on any machine (no GPU needed, none used):
# each command's --help lists exactly its flags; --flag=value works as --flag value; a flag
# a command does not take is refused (exit 2) by name; values are parsed strictly; bad
# shapes and layouts are refused with the flag's name before anything forks or touches a
# GPU or NCCL (with strace, when it works here, that is checked at the system calls);
# comet tune --out and the library's environment variables are checked before the run; a
# machine without a GPU gets exit code 3 and says so, under an external launcher too. One line per check, "PASS name" or
# "FAIL name: why" (or "SKIP name: why"), then "N passed, N failed, N skipped"; exit 1
# when any failed.
# Usage: tests/test_cli.sh [PATH/TO/comet]   (default build/comet)
set -u
comet=${1:-build/comet}
. "$(dirname "$0")/check.sh"

if [ ! -x "$comet" ]; then
    fail setup "$comet is not an executable file (give the comet binary's path)"
    finish
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Whatever gets past the flags meets no GPU: on a machine with GPUs too, a check that
# failed to stop a run ends at the GPU probe's message instead of running a benchmark.
export CUDA_VISIBLE_DEVICES=
unset RANK WORLD_SIZE LOCAL_RANK
# The library's own variables are set by the checks that test them, and only there.
unset COMET_TIMEOUT_MS COMET_PDL COMET_FIRST_WAVE COMET_TUNING_FILE

# run ARGS...: comet ARGS with a time limit; sets rc, out (its stdout) and err (its stderr).
run() {
    timeout 30 "$comet" "$@" >"$tmp/out" 2>"$tmp/err"
    rc=$?
    out=$(cat "$tmp/out")
    err=$(cat "$tmp/err")
}

# What a message looks like when the run got as far as a GPU, CUDA or NCCL.
gpu_words='CUDA|cuda|GPU|NCCL|nccl|driver'

# refused NAME WANTS ARGS...: comet ARGS exits 2, says nothing on stdout, and its stderr
# holds each of WANTS (';'-separated) and no word of a GPU, CUDA or NCCL.
refused() {
    local name=$1 wants=$2 want
    shift 2
    run "$@"
    if [ "$rc" -ne 2 ]; then fail "$name" "exit code $rc, expected 2 (stderr: $err)"; return; fi
    if [ -n "$out" ]; then fail "$name" "printed on stdout: $out"; return; fi
    IFS=';' read -r -a wants <<<"$wants"
    for want in "${wants[@]}"; do
        if [[ $err != *"$want"* ]]; then fail "$name" "stderr lacks '$want': $err"; return; fi
    done
    if [[ $err =~ $gpu_words ]]; then fail "$name" "refused by the GPU side, not by the flags: $err"; return; fi
    pass "$name"
}

# reaches_gpu NAME ARGS...: every check of comet ARGS passes; it stops only at the GPU
# probe (no GPU is visible here), with the exit code of "no usable GPU or NCCL" (3) and a
# sentence that says no GPU was found, not a CUDA call's error string.
reaches_gpu() {
    local name=$1
    shift
    run "$@"
    if [ "$rc" -eq 3 ] && [[ $err == *"no GPU found: "*"needs at least one Hopper GPU"* ]] &&
        [[ $err != *insufficient* ]] && [ "$(wc -l <"$tmp/err")" -eq 1 ]; then pass "$name"
    else fail "$name" "exit code $rc, expected 3 and one line saying no GPU was found (stderr: $err)"; fi
}

# ---------------------------------------------------------------------------------------
# Each command's --help: exit 0, its usage on stdout, exactly its flags.

declare -A takes
takes[bench]="--preset --hidden --ffn --experts --top-k --tokens --ep --tp --routing --skew --impl --warmup --fp8 --fp8-wgrad-cublaslt
 --iters --no-check --suite --json --seed --trace --train --ranks --timeout-ms --id-file"
takes[tune]="--preset --hidden --ffn --experts --top-k --tokens --ep --tp --routing --skew --warmup --iters
 --no-check --json --out --seed --trace --ranks --timeout-ms --id-file"
takes[bandwidth]="--mib --ranks --timeout-ms --id-file"
takes[gemm]="--preset --tokens --ep --iters --seed --sweep --fp8 --gemms --trace"
takes[presets]=""
takes[version]=""
commands="bench tune bandwidth gemm presets version"

sorted() { tr ' ' '\n' <<<"$1" | grep . | sort | tr '\n' ' '; } # sorted "WORDS": one line

for cmd in $commands; do
    for h in --help -h; do
        name="help-$cmd$h"
        run "$cmd" "$h"
        listed=$(grep -oE '^  --[a-z0-9-]+' <<<"$out" | tr -d ' ')
        if [ "$rc" -ne 0 ]; then fail "$name" "exit code $rc, expected 0 (stderr: $err)"
        elif [[ $out != "usage: comet $cmd"* ]]; then fail "$name" "stdout does not begin with its usage: $out"
        elif [ -n "$err" ]; then fail "$name" "printed on stderr: $err"
        elif [ "$(sorted "$listed")" != "$(sorted "${takes[$cmd]}")" ]; then
            fail "$name" "lists [$(sorted "$listed")], expected [$(sorted "${takes[$cmd]}")]"
        else pass "$name"; fi
    done
done

run help
all_flags=$(sorted "${takes[*]}")
missing=""
for f in $all_flags $commands; do [[ $out == *"$f"* ]] || missing="$missing $f"; done
if [ "$rc" -eq 0 ] && [ -z "$missing" ]; then pass "help-everything"
else fail "help-everything" "exit code $rc, missing:$missing"; fi
help_all=$out
# The environment comet reads and sets, and the exit codes, in `comet help` and in the
# --help of each command that runs.
notes=("exit status:" "  2 " "usage" "  3 " "no usable GPU or NCCL" "NCCL_NVLS_ENABLE" "set to 0 unless already set"
       "NVLink multicast is not used by comet" "COMET_TIMEOUT_MS" "COMET_TUNING_FILE")
help_notes() { # help_notes NAME: $out holds every one of notes
    local want
    for want in "${notes[@]}"; do
        if [[ $out != *"$want"* ]]; then fail "$1" "lacks '$want'"; return; fi
    done
    pass "$1"
}
help_notes "help-notes"
for cmd in bench tune bandwidth gemm; do
    run "$cmd" --help
    help_notes "help-notes-$cmd"
done
for h in --help -h; do
    run "$h"
    if [ "$rc" -eq 0 ] && [ "$out" == "$help_all" ]; then pass "help-everything$h"
    else fail "help-everything$h" "exit code $rc, or not comet help's text"; fi
done
run help gemm
gemm_help=$out
run gemm --help
if [ "$gemm_help" == "$out" ]; then pass "help-gemm-as-comet-help-gemm"
else fail "help-gemm-as-comet-help-gemm" "comet help gemm differs from comet gemm --help"; fi
refused "help-unknown-command" 'comet help;"nope"' help nope
run
if [ "$rc" -eq 2 ] && [[ $err == usage:* ]]; then pass "no-command"; else fail "no-command" "exit code $rc: $err"; fi
refused "unknown-command" 'unknown command;"nope"' nope
run version
if [ "$rc" -eq 0 ] && [[ $out == "comet "* ]]; then pass "version"; else fail "version" "exit code $rc: $out$err"; fi
version_out=$out
run --version
if [ "$rc" -eq 0 ] && [ "$out" == "$version_out" ] && [ -z "$err" ]; then pass "version--version"
else fail "version--version" "exit code $rc, expected 0 and comet version's line ($version_out): $out$err"; fi
refused "version--version-argument" 'comet version;"x"' --version x
run presets
if [ "$rc" -eq 0 ] && [[ $out == *mixtral-8x7b* ]]; then pass "presets"
else fail "presets" "exit code $rc: $out$err"; fi

# ---------------------------------------------------------------------------------------
# --flag=value as --flag value: every flag that takes a value, in every command that takes
# it, is accepted both ways (the --help after it ends the run once the flags are parsed);
# a switch takes no value.

declare -A good=(
    [--preset]=mixtral-8x7b [--hidden]=4096 [--ffn]=14336 [--experts]=8 [--top-k]=2 [--tokens]=1024
    [--ep]=2 [--tp]=1 [--routing]=skewed [--skew]=4.5 [--impl]=comet [--warmup]=2 [--iters]=10
    [--json]=out.json [--out]=tuning.txt [--seed]=0x2a [--ranks]=2 [--timeout-ms]=1000
    [--id-file]=comet.id [--mib]=64 [--gemms]=wgrad,dgrad
)
for cmd in $commands; do
    for f in ${takes[$cmd]}; do
        if [ -z "${good[$f]:-}" ]; then
            run "$cmd" "$f=x"
            if [ "$rc" -eq 2 ] && [[ $err == *"$f takes no value"* ]]; then pass "switch-$cmd$f=x"
            else fail "switch-$cmd$f=x" "exit code $rc, expected 2 with '$f takes no value': $err"; fi
            continue
        fi
        run "$cmd" "$f=${good[$f]}" --help
        rc_eq=$rc
        run "$cmd" "$f" "${good[$f]}" --help
        if [ "$rc_eq" -eq 0 ] && [ "$rc" -eq 0 ]; then pass "equals-$cmd$f"
        else fail "equals-$cmd$f" "exit codes $rc_eq ($f=${good[$f]}) and $rc ($f ${good[$f]}), expected 0"; fi
    done
done
# The value after '=' is the one used: the same refusals, the same shapes.
refused "equals-value-is-parsed" '--tokens "12x"' bench --tokens=12x
refused "equals-empty-value" '--tokens ""' bench --tokens=
refused "equals-value-reaches-the-config" '--hidden 100' bench --hidden=100 --ffn=256 --experts=8 --top-k=2
refused "equals-with-equals-inside" '--routing "skewed=1"' bench --routing=skewed=1
reaches_gpu "equals-valid-run" bench --preset=tiny --tokens=64 --routing=random --seed=7 --iters=3
reaches_gpu "space-valid-run" bench --preset tiny --tokens 64 --routing random --seed 7 --iters 3

# ---------------------------------------------------------------------------------------
# A flag (or argument) a command does not take: exit 2, naming it and the command.

refused "unused-gemm--mib" 'comet gemm;--mib' gemm --mib 5
refused "unused-bandwidth--tokens" 'comet bandwidth;--tokens' bandwidth --tokens 5
refused "unused-presets-argument" 'comet presets;"extra"' presets extra
refused "unused-version--foo" 'comet version;--foo' version --foo
refused "unused-presets--tokens" 'comet presets;--tokens' presets --tokens 5
refused "unused-tune--suite" 'comet tune;--suite' tune --suite
refused "unused-tune--impl" 'comet tune;--impl' tune --impl comet
refused "unused-tune--train" 'comet tune;--train' tune --train
refused "unused-bench--out" 'comet bench;--out' bench --out x.txt
refused "unused-bench--sweep" 'comet bench;--sweep' bench --sweep
refused "unused-bench--mib" 'comet bench;--mib' bench --mib=5
refused "unused-gemm--hidden" 'comet gemm;--hidden' gemm --hidden 64
refused "unused-gemm--ranks" 'comet gemm;--ranks' gemm --ranks 1
refused "unused-bandwidth--preset" 'comet bandwidth;--preset' bandwidth --preset all
refused "unused-bench-argument" 'comet bench;"mixtral-8x7b"' bench mixtral-8x7b
refused "unknown-flag" 'comet bench;--foo' bench --foo
refused "unknown-short-flag" 'comet bench;-x' bench -x

# ---------------------------------------------------------------------------------------
# A flag given twice is refused by name (the second would silently win), and --skew only
# goes with skewed routing (or the suite's skewed cases).

refused "twice-preset" '--preset given twice' bench --preset tiny --preset mixtral-8x7b
refused "twice-tokens" '--tokens given twice' bench --tokens 5 --tokens 6
refused "twice-tokens-equals" '--tokens given twice' tune --tokens=5 --tokens 5
refused "twice-switch" '--no-check given twice' bench --no-check --no-check
refused "twice-gemm-preset" '--preset given twice' gemm --preset all --preset tiny
refused "twice-mib" '--mib given twice' bandwidth --mib 1 --mib=2
refused "skew-without-routing" '--skew;the routing is balanced;--routing skewed' bench --skew 4
refused "skew-with-random" '--skew;the routing is random' bench --skew 4 --routing random
refused "skew-tune-without-routing" '--skew;--routing skewed' tune --skew 2
reaches_gpu "skew-with-skewed" bench --preset tiny --routing skewed --skew 4
reaches_gpu "skew-with-suite" bench --suite --skew 4

# ---------------------------------------------------------------------------------------
# Strict values: the whole string, finite, in range; the message names the flag, the value
# and what is allowed.

refused "strict-preset-comma" '--preset ",";expected' bench --preset ,
refused "strict-preset-empty" '--preset "";expected' bench --preset ""
refused "strict-preset-trailing-comma" '--preset "mixtral-8x7b,";expected' bench --preset mixtral-8x7b,
refused "strict-preset-empty-name" '--preset "tiny,,tiny"' bench --preset tiny,,tiny
refused "strict-preset-unknown" '--preset "nope";unknown preset;mixtral-8x7b' bench --preset nope
refused "strict-skew-inf" '--skew "inf";>= 1' bench --skew inf
refused "strict-skew-nan" '--skew "nan";>= 1' bench --skew nan
refused "strict-skew-junk" '--skew "8abc";>= 1' bench --skew 8abc
refused "strict-skew-below-1" '--skew "0.5";>= 1' bench --skew 0.5
refused "strict-skew-empty" '--skew "";>= 1' bench --skew=
refused "strict-seed-banana" '--seed "banana";expected' bench --seed banana
refused "strict-seed-negative" '--seed "-1";expected' bench --seed -1
refused "strict-seed-junk" '--seed "12x";expected' gemm --seed 12x
refused "strict-seed-bare-0x" '--seed "0x";expected' bench --seed 0x
refused "strict-seed-too-big" '--seed "18446744073709551616";expected' bench --seed 18446744073709551616
refused "strict-tokens-junk" '--tokens "5x";whole number' bench --tokens 5x
refused "strict-tokens-float" '--tokens "1e3";whole number' bench --tokens 1e3
refused "strict-tokens-zero" '--tokens "0";>= 1' bench --tokens 0
refused "strict-tokens-blank" '--tokens " 5";whole number' bench --tokens " 5"
refused "strict-tokens-overflow" '--tokens "99999999999999999999";whole number' bench --tokens 99999999999999999999
refused "strict-iters-zero" '--iters "0";1..100000' bench --iters 0
refused "strict-gemm-iters" '--iters "65";1..64' gemm --iters 65
refused "strict-gemm-gemms" '--gemms "fwd";forward, dgrad, wgrad or all' gemm --gemms fwd
refused "strict-gemm-gemms-empty" '--gemms "wgrad,";forward, dgrad, wgrad or all' gemm --gemms wgrad,
reaches_gpu "gemm-gemms-valid-run" gemm --fp8 --gemms wgrad --preset mixtral-8x7b
# --trace: gemm's with --fp8 only, bench's without it.
refused "gemm-trace-needs-fp8" 'comet gemm: --trace;give --fp8 with it' gemm --trace
refused "bench-fp8-trace" '--fp8 times its own table: leave out --trace' bench --fp8 --trace
reaches_gpu "gemm-fp8-trace-valid-run" gemm --fp8 --trace --gemms forward --preset qwen2-moe-2.7b
# --fp8-wgrad-cublaslt: the FP8 training step's, so with --fp8 --train only.
refused "bench-wgrad-cublaslt-needs-fp8-train" '--fp8-wgrad-cublaslt;give --fp8 --train with it' bench --fp8-wgrad-cublaslt
refused "bench-wgrad-cublaslt-needs-train" '--fp8-wgrad-cublaslt;give --fp8 --train with it' bench --fp8 --fp8-wgrad-cublaslt
reaches_gpu "bench-wgrad-cublaslt-valid-run" bench --fp8 --train --fp8-wgrad-cublaslt --preset mixtral-8x7b
refused "strict-warmup-negative" '--warmup "-1";0..10000' tune --warmup -1
refused "strict-mib-zero" '--mib "0";1..16384' bandwidth --mib 0
refused "strict-ranks-zero" '--ranks "0";1..' bench --ranks 0
refused "strict-ep-too-big" '--ep "1000";1..' bench --ep 1000
refused "strict-routing" '--routing "diagonal";balanced, random or skewed' bench --routing diagonal
refused "strict-impl" '--impl "neither";baseline, comet or all' bench --impl neither
refused "strict-json-empty" '--json "";path' bench --json ""
refused "strict-missing-value" '--tokens needs a value' bench --tokens
refused "strict-missing-value-before-flag" '--json needs a value' bench --json --no-check
refused "strict-timeout-junk" '--timeout-ms "5s";whole number' bandwidth --timeout-ms 5s

# ---------------------------------------------------------------------------------------
# Shapes and layouts: refused by the library's own rules, the flag named, before anything
# forks or touches a GPU or NCCL.

refused "shape-hidden" '--hidden 100' bench --hidden 100 --ffn 256 --experts 8 --top-k 2
refused "shape-ffn" '--ffn 100' bench --hidden 256 --ffn 100 --experts 8 --top-k 2
refused "shape-top-k-above-experts" '--top-k 9;--experts 7' bench --hidden 256 --ffn 256 --experts 7 --top-k 9
refused "shape-experts" '--experts 5000' bench --hidden 256 --ffn 256 --experts 5000 --top-k 2
refused "shape-tokens" '--tokens 2000000' bench --tokens 2000000
refused "shape-tune-hidden" '--hidden 100' tune --hidden 100 --ffn 256 --experts 8 --top-k 2
refused "layout-ep-tp" '--ep 3;--tp 5' bench --ep 3 --tp 5
refused "layout-tp-ffn" '--tp;--ffn 14336' bench --preset mixtral-8x7b --tp 3
refused "layout-ep-experts" '--ep 3;--experts 8' bench --preset mixtral-8x7b --ep 3
refused "layout-ranks-experts" '--ranks 3;--experts 8' bench --preset mixtral-8x7b --ranks 3
refused "layout-ranks-ep-tp" '--ep 2 x --tp 2;--ranks 8' bench --preset tiny --ep 2 --tp 2 --ranks 8
refused "layout-suite-tp" '--tp' bench --suite --tp 5
refused "layout-each-preset" '--preset qwen2-moe-2.7b;--ffn 1408' bench --preset mixtral-8x7b,qwen2-moe-2.7b --tp 4
refused "shape-gemm-tokens" '--tokens 2000000' gemm --tokens 2000000
refused "layout-gemm-ep" '--ep 3;--experts 8' gemm --preset mixtral-8x7b --ep 3
refused "shape-partial" 'missing: --ffn --experts --top-k' bench --hidden 256
refused "shape-and-preset" '--preset;--hidden' bench --preset tiny --hidden 256 --ffn 256 --experts 8 --top-k 2
refused "suite-and-tokens" '--suite;--tokens' bench --suite --tokens 1024
export RANK=0 WORLD_SIZE=3
refused "layout-external-world" 'WORLD_SIZE=3;--experts 8' bench --preset mixtral-8x7b --id-file "$tmp/id"
if [ -e "$tmp/id" ]; then fail "layout-external-no-id-file" "$tmp/id was written"
else pass "layout-external-no-id-file"; fi
refused "external-and-ranks" '--ranks;--id-file' bench --id-file "$tmp/id" --ranks 3
unset RANK WORLD_SIZE
# Under an external launcher the same words and code as the local launcher's, not a rank's
# raw CUDA call, and no id file left for peers that would wait on it; without RANK and
# WORLD_SIZE the launcher's refusal (usage) comes first.
for cmd in bench tune bandwidth; do
    export RANK=0 WORLD_SIZE=1
    reaches_gpu "external-no-gpu-$cmd" "$cmd" --id-file "$tmp/id"
    unset RANK WORLD_SIZE
    if [[ $err == *cudaSetDevice* ]]; then fail "external-no-gpu-$cmd-words" "a raw CUDA call: $err"
    else pass "external-no-gpu-$cmd-words"; fi
done
if [ -e "$tmp/id" ]; then fail "external-no-gpu-no-id-file" "$tmp/id was written"
else pass "external-no-gpu-no-id-file"; fi
refused "external-without-rank" 'RANK and WORLD_SIZE;RANK=unset' bench --id-file "$tmp/id"
reaches_gpu "layout-valid" bench --preset mixtral-8x7b --ep 2 --tp 2 --tokens 128
reaches_gpu "layout-valid-tp-alone" bench --preset mixtral-8x7b --tp 2

# At the system calls: a refused shape forks nothing and opens no file that `comet version`
# (which touches no GPU) does not open too; the libraries' loading (cuBLAS looks for the
# driver library then) is common to both. The same tool with a good shape does fork its GPU
# probe, so the trace is seen to work.
traced() { # traced FILE ARGS...: comet ARGS' forks and opened paths, a line each, into FILE
    local file=$1
    shift
    strace -f -qq -e trace=clone,clone3,fork,vfork,openat -o "$tmp/strace" "$comet" "$@" >/dev/null 2>&1
    sed -nE 's/.*(clone3?|v?fork)\(.*/\1/p; s/.*openat\([^"]*"([^"]*)".*/\1/p' "$tmp/strace" | sort -u >"$file"
}
if ! strace -f -qq -e trace=none -o /dev/null true >/dev/null 2>&1; then
    skip "syscalls-bad-shape" "strace is missing or cannot trace here"
    skip "syscalls-good-shape" "strace is missing or cannot trace here"
else
    traced "$tmp/version.calls" version
    traced "$tmp/bad.calls" bench --hidden 100 --ffn 256 --experts 8 --top-k 2
    extra=$(comm -23 "$tmp/bad.calls" "$tmp/version.calls" | tr '\n' ' ')
    if [ -z "$extra" ]; then pass "syscalls-bad-shape"
    else fail "syscalls-bad-shape" "beyond what comet version does: $extra"; fi
    traced "$tmp/good.calls" bench --preset tiny --tokens 64
    if grep -Eq 'clone|fork' "$tmp/good.calls"; then pass "syscalls-good-shape"
    else fail "syscalls-good-shape" "no fork seen on the way to the GPU probe: the trace sees nothing"; fi
fi

# ---------------------------------------------------------------------------------------
# The library's environment variables (src/params.c's table, the tuning file's lines by
# src/tune.c's parser): a malformed one is refused with its name and value (exit 2) before
# any GPU check, as comet_comm_create would refuse it on a GPU machine.

env_refused() { # env_refused NAME WANTS VAR=VALUE ARGS...: refused NAME WANTS ARGS with VAR=VALUE set
    local name=$1 wants=$2 var=${3%%=*} value=${3#*=}
    shift 3
    export "$var=$value"
    refused "$name" "$wants" "$@"
    unset "$var"
}
env_refused "env-timeout-ms" "\$COMET_TIMEOUT_MS = 'abc';1..3600000" COMET_TIMEOUT_MS=abc bench --preset tiny
env_refused "env-timeout-ms-zero" "\$COMET_TIMEOUT_MS = '0'" COMET_TIMEOUT_MS=0 bandwidth
env_refused "env-pdl" "\$COMET_PDL = '2';0 (ordinary launches) or 1" COMET_PDL=2 gemm --preset tiny
env_refused "env-first-wave" "\$COMET_FIRST_WAVE = 'off'" COMET_FIRST_WAVE=off tune --preset tiny --out "$tmp/t.txt"
env_refused "env-tuning-missing" "\$COMET_TUNING_FILE = '$tmp/none.txt';No such file" \
    COMET_TUNING_FILE="$tmp/none.txt" bench --preset tiny
env_refused "env-tuning-directory" "\$COMET_TUNING_FILE = '$tmp';a directory, not a regular file" \
    COMET_TUNING_FILE="$tmp" bench --preset tiny
env_refused "env-under-id-file" "\$COMET_PDL = 'yes'" COMET_PDL=yes bench --preset tiny --id-file "$tmp/id"
printf '# comet tuning file\n2 8 2 4096 14336 8192 : x bulk 0 1 dynamic push\n' >"$tmp/bad-tuning.txt"
env_refused "env-tuning-malformed-line" \
    "\$COMET_TUNING_FILE;$tmp/bad-tuning.txt line 2: field 7 (dispatch_blocks) = 'x': must be a whole number" \
    COMET_TUNING_FILE="$tmp/bad-tuning.txt" bench --preset tiny
printf '2 8 2 4096 14336 8192 : 8 bulk 0 1 dynamic push tail\n' >"$tmp/bad-tuning.txt"
env_refused "env-tuning-too-many-fields" "\$COMET_TUNING_FILE;line 1: more than 12 fields" \
    COMET_TUNING_FILE="$tmp/bad-tuning.txt" bench --preset tiny
# Unreadable: mode 0, read by a user other than root (root reads any file).
printf '2 8 2 4096 14336 8192 : 8 bulk 0 1 dynamic push\n' >"$tmp/good-tuning.txt"
cp "$tmp/good-tuning.txt" "$tmp/unreadable.txt"
chmod 0 "$tmp/unreadable.txt"
if [ "$(id -u)" -ne 0 ]; then
    env_refused "env-tuning-unreadable" "\$COMET_TUNING_FILE = '$tmp/unreadable.txt';Permission denied" \
        COMET_TUNING_FILE="$tmp/unreadable.txt" bench --preset tiny
elif setpriv --reuid=65534 --regid=65534 --clear-groups true 2>/dev/null; then
    chmod 711 "$tmp" # nobody may reach the file, and finds it unreadable
    export COMET_TUNING_FILE="$tmp/unreadable.txt"
    timeout 30 setpriv --reuid=65534 --regid=65534 --clear-groups "$comet" bench --preset tiny >"$tmp/out" 2>"$tmp/err"
    rc=$?
    unset COMET_TUNING_FILE
    chmod 700 "$tmp"
    err=$(cat "$tmp/err")
    if [ "$rc" -eq 2 ] && [[ $err == *"\$COMET_TUNING_FILE = '$tmp/unreadable.txt': Permission denied"* ]]; then
        pass "env-tuning-unreadable"
    else fail "env-tuning-unreadable" "exit code $rc, expected 2 naming the file and 'Permission denied': $err"; fi
else
    skip "env-tuning-unreadable" "running as root, and setpriv cannot run comet as another user here"
fi
# Good values pass: the run goes on to the GPU probe. Commands that touch no GPU do not read them.
export COMET_TIMEOUT_MS=7000 COMET_PDL=0 COMET_FIRST_WAVE=1 COMET_TUNING_FILE="$tmp/good-tuning.txt"
reaches_gpu "env-good-values" bench --preset tiny
unset COMET_TIMEOUT_MS COMET_PDL COMET_FIRST_WAVE COMET_TUNING_FILE
export COMET_PDL=2
run presets
unset COMET_PDL
if [ "$rc" -eq 0 ]; then pass "env-not-read-by-presets"; else fail "env-not-read-by-presets" "exit code $rc: $err"; fi

# ---------------------------------------------------------------------------------------
# comet tune --out (and --json): checked before the run, and no file left behind by it.

refused "tune-out-no-directory" "--out $tmp/none/t.txt;cannot be written" tune --out "$tmp/none/t.txt"
refused "tune-out-a-directory" "--out $tmp;cannot be written" tune --out "$tmp"
refused "bench-json-no-directory" "--json $tmp/none/r.json;cannot be written" bench --json "$tmp/none/r.json"
reaches_gpu "tune-out-writable" tune --preset tiny --out "$tmp/t.txt"
if [ -e "$tmp/t.txt" ]; then fail "tune-out-not-left-behind" "$tmp/t.txt exists after a run that did not start"
else pass "tune-out-not-left-behind"; fi
echo "keep me" >"$tmp/kept.txt"
reaches_gpu "tune-out-existing" tune --preset tiny --out="$tmp/kept.txt"
if [ "$(cat "$tmp/kept.txt")" == "keep me" ]; then pass "tune-out-existing-kept"
else fail "tune-out-existing-kept" "the existing tuning file was changed"; fi

# ---------------------------------------------------------------------------------------
# comet bench's whole-layer figures: one per setting, each call timed whole, the sweeps'
# best in turns with the cost model's and the baseline (not a second, back-to-back figure
# for the same settings beside the baseline's row). Seen only on a GPU, so checked here in
# the tool's text: the old label is gone and the in-turns line names the baseline.

if grep -q -a "best knobs of the sweeps" "$comet"; then
    fail "bench-one-whole-figure-per-setting" "$comet still prints a back-to-back 'best knobs of the sweeps' figure"
elif ! grep -q -a "the whole layer in turns, each call timed whole" "$comet" ||
    ! grep -q -a "x the baseline's %.3f ms), the cost model's" "$comet"; then
    fail "bench-one-whole-figure-per-setting" "$comet lacks the in-turns line with the baseline"
else pass "bench-one-whole-figure-per-setting"; fi

finish
