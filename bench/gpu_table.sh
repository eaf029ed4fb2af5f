#!/usr/bin/env bash
# The CUDA table of issue 14 in one command: U-Net forward time and peak memory, fp16, ComfyUI's SDPA
# attention, SD1.5 at 512, 1024 and 2048 px and SDXL at 1024 and 2048 px; variants: no patch, the core node,
# Apply ToMe's default (ours-qkv), Apply ToDo factor 2, and the README's fast setting ("fast": SD1.5
# self+cross at max_downsample 2, SDXL scope all at max_downsample 4). Writes bench/results/gpu_table/:
# gpu_table.md (both tables under the machine and the commands), and unet_bench.py's JSON, Markdown and plot
# for each family. Memory is measured in-process (CUDA's allocator peak; on the CPU, see unet_bench.py).
# Then issue 27's full-length video rows (bench/dit_bench.py, bf16, SDPA, 4 blocks of each model): Wan 2.1 1.3B and
# 14B at 832x480 x 81 frames, Wan 2.1 14B at 1280x720 x 81, Wan 2.2 TI2V-5B at 1280x704 x 121, HunyuanVideo at
# 848x480 x 61, LTX-Video at 768x512 x 121; no patch, ToDo 2, ToDo 2 time_factor 2, ToMe 0.5 and 0.75 k and v
# only, each with its ideal, matching share and peak memory. Then issue 33's block scope (bench/dit_bench.py
# --scope attention block, bf16, SDPA): Flux at 1024 px with all its 19 + 38 blocks, SD3.5 medium at 1024 px with
# all 24, Qwen-Image at 1024 px (12 of its 60 blocks), Wan 2.1 1.3B (all 30 blocks) and 14B (10 of 40) at
# 832x480 x 81 frames, HunyuanVideo (10 of its 20 double blocks) at 848x480 x 61 frames, LTX-Video 2B (all 28
# blocks) at 768x512 x 121 frames, Mochi (12 of 48 blocks) at 848x480 x 85 frames, Z-Image (its 30 main layers)
# and HiDream I1 (12 of its 48 blocks) at 1024 px; ToMe 0.5 and ToDo 2 at
# dit_scope block with skips 0:0, the default 2:2 and SD3.5's fast row's 3:3, each beside its ideal (the same
# blocks on as many tokens, reduced for free), ToMe 0.5 with one matching for every block of a model call beside
# them (reuse_blocks 100: what a GPU saves by it), and the attention scope's ToDo 2 and ToMe 0.5.
# And issue 27's counts (bench/host_reads_bench.py): the host reads, blocking copies and operators each node
# adds to a model call of SD1.5, SDXL, Flux and Wan; they do not depend on the device and are counted on the CPU.
#
#   bash bench/gpu_table.sh               # on a CUDA machine (meant for one H200: a few minutes)
#   bash bench/gpu_table.sh --block-only  # the block scope's rows alone (a few minutes, mostly building models)
#   bash bench/gpu_table.sh --smoke       # the same run on a narrow model at tiny sizes; runs on the CPU (CI)
#   options: --out DIR (default bench/results/gpu_table), --repeats N (default 5; smoke 1)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}

out=bench/results/gpu_table
smoke=0
block_only=0
repeats=5
while [ $# -gt 0 ]; do
    case "$1" in
        --smoke) smoke=1; repeats=1 ;;
        --block-only) block_only=1 ;;
        --out) out=$2; shift ;;
        --repeats) repeats=$2; shift ;;
        *) echo "gpu_table.sh: unknown option $1 (use --smoke, --block-only, --out DIR, --repeats N)" >&2; exit 2 ;;
    esac
    shift
done

if [ "$smoke" = 1 ]; then  # the layouts kept, 32 channels wide; sizes where a CPU takes seconds
    sd15_px=(64); sdxl_px=(64); narrow=(--channels 32 --context-dim 32); count_models=(SD1.5 Flux)
    videos=("--model tiny --dtype fp32")  # each DiT test model at a 32x32 latent
    blocks=("--model tiny --blocks 5 --dtype fp32")  # the block scope's test models with 5 blocks each
else
    sd15_px=(512 1024 2048); sdxl_px=(1024 2048); narrow=(); count_models=(SD1.5 SDXL Flux "Wan 2.1")
    videos=("--model wan13b wan14b --frames 81" "--model wan14b --size 1280x720 --frames 81"
            "--model wan22ti2v --frames 121" "--model hunyuan --size 848x480 --frames 61"
            "--model ltxv --size 768x512 --frames 121")
    blocks=("--model flux --px 1024 --flux-blocks 19 38" "--model sd35m" "--model qwen --px 1024 --blocks 12"
            "--model wan13b --frames 81" "--model wan14b --frames 81 --blocks 10"
            "--model hunyuan --size 848x480 --frames 61 --blocks 10" "--model ltxv --size 768x512 --frames 121"
            "--model mochi --size 848x480 --frames 85 --blocks 12" "--model zimage" "--model hidream --blocks 12")
fi
video_common=(--blocks 4 --ratio 0.5 0.75 --merge kv --time-factor 2 --repeats "$repeats")
block_common=(--scope attention block --ratio 0.5 --merge qkv kv --block-factor 2 --skips 0:0 2:2 3:3
              --reuse-blocks 100 --repeats "$repeats")
if [ "$smoke" = 0 ]; then video_common+=(--dtype bf16); block_common+=(--dtype bf16); fi
common=(--dtype fp16 --attention sdpa --variants core ours-qkv fast --todo 2 --memory in-process
        --repeats "$repeats" --out "$out" "${narrow[@]}")

# bench/dit_bench.py once per model spec: dit_rows PREFIX SPECS OPTIONS TABLES (the names of arrays: the specs,
# each a string of options, and the options they share; the table folders $out/PREFIX_<index> are appended to
# TABLES, each command to commands).
dit_rows() {
    local prefix=$1 index spec
    local -n specs=$2 options=$3 tables=$4
    for index in "${!specs[@]}"; do
        read -r -a spec <<< "${specs[$index]}"
        command=("$PYTHON" bench/dit_bench.py "${spec[@]}" "${options[@]}" --out "$out/${prefix}_$index")
        echo "+ ${command[*]}" >&2
        "${command[@]}" > /dev/null
        commands+=("${command[*]}")
        tables+=("$out/${prefix}_$index")
    done
}

mkdir -p "$out"
commands=()
video_tables=()
if [ "$block_only" = 0 ]; then
    for family in sd15 sdxl; do
        if [ "$family" = sd15 ]; then px=("${sd15_px[@]}"); else px=("${sdxl_px[@]}"); fi
        command=("$PYTHON" bench/unet_bench.py --family "$family" --px "${px[@]}" "${common[@]}")
        echo "+ ${command[*]}" >&2
        "${command[@]}"
        commands+=("${command[*]}")
    done

    dit_rows video videos video_common video_tables
fi

block_tables=()
dit_rows block blocks block_common block_tables

counts=("$PYTHON" bench/host_reads_bench.py --models "${count_models[@]}" --out "$out")
if [ "$block_only" = 0 ]; then
    echo "+ ${counts[*]}" >&2
    "${counts[@]}" > /dev/null
fi

machine=$("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available()
    else "CPU (no CUDA)", "| torch", torch.__version__)')
{
    if [ "$block_only" = 0 ]; then
        echo "# U-Net forward, fp16, SDPA: time and peak memory"
    else
        echo "# DiT block scope (dit_scope block), bf16, SDPA"
    fi
    echo
    echo "$(date -u +%Y-%m-%dT%H:%MZ), $machine$([ "$smoke" = 1 ] && echo ', SMOKE RUN (narrow model, tiny sizes)')."
    if [ "$block_only" = 0 ]; then
        echo "peak MiB: the forward's peak above the loaded model; attention MiB: the largest rise inside one"
        echo "attention call. fast: SD1.5 self+cross at max_downsample 2; SDXL scope all at max_downsample 4."
    fi
    echo
    for command in "${commands[@]}"; do echo "    $command"; done
    if [ "$block_only" = 0 ]; then
        for family in sd15 sdxl; do
            echo
            cat "$out/unet_${family}_fp16_sdpa.md"
        done
        echo
        echo "## Video at full length (DiT forward, SDPA)"
        echo
        for table in "${video_tables[@]}"; do
            cat "$table"/dit_*.md
            echo
        done
    fi
    echo "## Block scope (issue 33: dit_scope block beside attention, DiT forward, SDPA)"
    echo
    echo "A block row's ideal is its ideal- twin's measured speed-up: the same blocks on as many image tokens,"
    echo "reduced for free (bench/dit_bench.py's docstring). block tokens: the tokens each block ran on, in order."
    echo
    for table in "${block_tables[@]}"; do
        cat "$table"/dit_*.md
        echo
    done
    if [ "$block_only" = 0 ]; then
        echo "## What each node adds to a model call (counted on the CPU)"
        echo
        echo "    ${counts[*]}"
        echo
        cat "$out/host_reads.md"
    fi
} > "$out/gpu_table.md"
cat "$out/gpu_table.md"
