#!/usr/bin/env bash
# Download Llama 2 weights with the presigned URL from Meta's e-mail, then check every file against its md5
# checklist. Interrupted downloads resume (wget --continue).
#
# Interactive, like Meta's script (asks for the URL and the models):
#   ./download.sh
# Non-interactive (flags, or the environment variables the reference script used as names):
#   ./download.sh --url 'https://download.llamameta.net/*?Policy=...' --models 7B,13B-chat --target-dir weights
#   PRESIGNED_URL='https://...' MODEL_SIZE=7B TARGET_FOLDER=weights ./download.sh
#
# Exits non-zero, naming the file, when a download fails or a checksum does not match.
set -euo pipefail

ALL_MODELS="7B,13B,70B,7B-chat,13B-chat,70B-chat"

usage() {
    cat <<EOF
usage: $0 [--url URL] [--models LIST] [--target-dir DIR]

  --url URL          presigned URL from Meta's e-mail; every '*' in it is replaced by each file's path
                     (env PRESIGNED_URL)
  --models LIST      comma-separated, from ${ALL_MODELS}; empty means all (env MODEL_SIZE)
  --target-dir DIR   where to put the files, default . (env TARGET_FOLDER)

Values not given by a flag or the environment are asked for on standard input.
EOF
}

die() {
    echo "error: $*" >&2
    exit 1
}

PRESIGNED_URL="${PRESIGNED_URL:-}"
TARGET_FOLDER="${TARGET_FOLDER:-.}"
MODELS_GIVEN=0
if [[ -n "${MODEL_SIZE+set}" ]]; then MODELS_GIVEN=1; fi
MODEL_SIZE="${MODEL_SIZE:-}"

need_value() { [[ $# -ge 2 ]] || { echo "error: $1 needs a value" >&2; usage >&2; exit 2; }; }
while [[ $# -gt 0 ]]; do
    case "$1" in
        --url) need_value "$@"; PRESIGNED_URL="$2"; shift 2 ;;
        --url=*) PRESIGNED_URL="${1#*=}"; shift ;;
        --models) need_value "$@"; MODEL_SIZE="$2"; MODELS_GIVEN=1; shift 2 ;;
        --models=*) MODEL_SIZE="${1#*=}"; MODELS_GIVEN=1; shift ;;
        --target-dir) need_value "$@"; TARGET_FOLDER="$2"; shift 2 ;;
        --target-dir=*) TARGET_FOLDER="${1#*=}"; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "error: unknown argument $1" >&2; usage >&2; exit 2 ;;
    esac
done

command -v wget >/dev/null 2>&1 || die "wget is required but not installed (apt-get install wget, brew install wget)"

if [[ -z "$PRESIGNED_URL" ]]; then
    read -r -p "Enter the URL from email: " PRESIGNED_URL || die "no URL given: pass --url or set PRESIGNED_URL"
    echo ""
fi
PRESIGNED_URL="${PRESIGNED_URL//[[:space:]]/}"
[[ -n "$PRESIGNED_URL" ]] || die "no URL given: pass --url or set PRESIGNED_URL"
[[ "$PRESIGNED_URL" == *'*'* ]] || die "the URL has no '*' to replace with file paths: copy it whole from Meta's e-mail"

if [[ $MODELS_GIVEN == 0 ]]; then
    read -r -p "Enter the list of models to download without spaces (${ALL_MODELS}), or press Enter for all: " MODEL_SIZE \
        || die "no model list given: pass --models or set MODEL_SIZE"
fi
MODEL_SIZE="${MODEL_SIZE//[[:space:]]/}"
[[ -n "$MODEL_SIZE" ]] || MODEL_SIZE="$ALL_MODELS"

# model name -> "<directory> <number of shards>"
model_info() {
    case "$1" in
        7B) echo "llama-2-7b 1" ;;
        7B-chat) echo "llama-2-7b-chat 1" ;;
        13B) echo "llama-2-13b 2" ;;
        13B-chat) echo "llama-2-13b-chat 2" ;;
        70B) echo "llama-2-70b 8" ;;
        70B-chat) echo "llama-2-70b-chat 8" ;;
        *) return 1 ;;
    esac
}
for m in ${MODEL_SIZE//,/ }; do
    model_info "$m" >/dev/null || die "unknown model '$m': choose from ${ALL_MODELS}"
done

md5_of() {
    if command -v md5sum >/dev/null 2>&1; then
        md5sum "$1" | cut -d' ' -f1
    elif command -v md5 >/dev/null 2>&1; then
        md5 -q "$1"
    else
        openssl md5 -r "$1" | cut -d' ' -f1
    fi
}

if [[ -t 1 ]]; then PROGRESS="bar:force:noscroll"; else PROGRESS="dot:giga"; fi

# fetch PATH DEST: the presigned URL with '*' replaced by PATH (the signature is never printed)
fetch() {
    local url="${PRESIGNED_URL//\*/$1}"
    echo "downloading $1"
    wget --continue --progress="$PROGRESS" "$url" -O "$2" || die "download of $1 failed (wget exit code $?)"
}

# verify DIR CHECKLIST FILE...: every listed file must match its md5 and every FILE must be listed
verify() {
    local dir="$1" list="$2" failed=0 sum name actual listed=" "
    shift 2
    while read -r sum name || [[ -n "$sum" ]]; do
        sum="${sum%$'\r'}"
        name="${name%$'\r'}"
        name="${name#\*}"
        [[ -n "$sum" ]] || continue
        listed+="$name "
        if [[ ! -f "$dir/$name" ]]; then
            echo "error: $dir/$name is listed in $list but missing" >&2
            failed=1
            continue
        fi
        actual="$(md5_of "$dir/$name")"
        if [[ "$actual" == "$sum" ]]; then
            echo "$dir/$name: OK"
        else
            echo "error: checksum mismatch for $dir/$name (md5 $actual, expected $sum): the file is corrupt or" \
                "incomplete; delete it and run download.sh again" >&2
            failed=1
        fi
    done <"$dir/$list"
    for name in "$@"; do
        if [[ "$listed" != *" $name "* ]]; then
            echo "error: $dir/$name is not listed in $list, so it cannot be verified" >&2
            failed=1
        fi
    done
    return $failed
}

mkdir -p "$TARGET_FOLDER"

echo "Downloading LICENSE and Acceptable Usage Policy"
fetch LICENSE "$TARGET_FOLDER/LICENSE"
fetch USE_POLICY.md "$TARGET_FOLDER/USE_POLICY.md"

echo "Downloading tokenizer"
fetch tokenizer.model "$TARGET_FOLDER/tokenizer.model"
fetch tokenizer_checklist.chk "$TARGET_FOLDER/tokenizer_checklist.chk"
verify "$TARGET_FOLDER" tokenizer_checklist.chk tokenizer.model || die "tokenizer verification failed"

for m in ${MODEL_SIZE//,/ }; do
    read -r MODEL_PATH SHARDS <<<"$(model_info "$m")"
    echo "Downloading ${MODEL_PATH}"
    mkdir -p "$TARGET_FOLDER/$MODEL_PATH"
    files=()
    for ((s = 0; s < SHARDS; s++)); do
        shard="$(printf 'consolidated.%02d.pth' "$s")"
        fetch "$MODEL_PATH/$shard" "$TARGET_FOLDER/$MODEL_PATH/$shard"
        files+=("$shard")
    done
    fetch "$MODEL_PATH/params.json" "$TARGET_FOLDER/$MODEL_PATH/params.json"
    fetch "$MODEL_PATH/checklist.chk" "$TARGET_FOLDER/$MODEL_PATH/checklist.chk"
    files+=(params.json)
    echo "Checking checksums"
    verify "$TARGET_FOLDER/$MODEL_PATH" checklist.chk "${files[@]}" || die "verification of ${MODEL_PATH} failed"
done
echo "All files downloaded and verified in $TARGET_FOLDER"
