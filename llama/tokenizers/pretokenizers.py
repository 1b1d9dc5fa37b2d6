"""GGUF pre-tokenizers: the `tokenizer.ggml.pre` name of a byte-level BPE vocabulary -> how text is split
before BPE, as llama.cpp splits it (src/llama-vocab.cpp, the copy in llama-cpp-python 0.3.36) and as the
model's Hugging Face tokenizer.json does.

Each type is a list of regexes applied in turn, each match isolated (llama.cpp's regex_exprs; a `Split` of
Hugging Face `tokenizers`), then GPT-2's byte-to-unicode mapping. Where llama.cpp rewrote a tokenizer.json regex
for its own regex engine and kept the original beside it, the original is used here: `tokenizers` runs it
as Hugging Face does. Digit grouping is what most often differs: GPT-2 keeps digit runs whole, SmolLM and
Qwen2 split single digits, Llama 3 and DeepSeek-V3 group one to three.

A missing name is llama.cpp's 'default' (with its warning); a name llama.cpp does not know is refused, and so
are the few types that llama.cpp splits with hand-written code rather than regexes.
"""

import warnings
from dataclasses import dataclass
from typing import Dict, Tuple

from tokenizers import Regex, pre_tokenizers

LLAMA3 = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+["
    '\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+',
)
JAIS2 = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+["
    '\\r\\n]*|\\s*[\\r\\n]+|\\s{512}(?!\\S)|\\s{256}(?!\\S)|\\s{128}(?!\\S)|\\s{64}(?!\\S)|\\s{32}('
    '?!\\S)|\\s{16}(?!\\S)|\\s{8}(?!\\S)|\\s{4}(?!\\S)|\\s{1,2}(?!\\S)|\\s{1}',
)
DEEPSEEK_LLM = (
    '[\r\n]',
    '\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-'
    'Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-'
    'ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+',
    '\\s?[!-/:-~！-／：-～‘-‟\u3000-。]+',
    '\\s+$',
    '[一-龥ࠀ-一가-\ud7ff]+',
    '\\p{N}+',
)
DEEPSEEK3_LLM = (
    '\\p{N}{1,3}',
    '[一-龥\u3040-ゟ゠-ヿ]+',
    '[!"#$%&\'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]'
    '+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+',
)
SPARK2_5 = (
    '\\p{N}{1,3}',
    '[一-龥\u3040-ゟ゠-ヿ]+',
    '[!"#$%&\'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]'
    '+| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+',
    '\\p{N}',
)
YOUTU = (
    '[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥\u3040-ゟ゠-ヿ]+',
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?:'["
    "sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p"
    "{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL"
    "][lL]|'[dD])?|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
)
DEEPSEEK_CODER = (
    '[\r\n]',
    '\\s?\\p{L}+',
    '\\s?\\p{P}+',
    '[一-龥ࠀ-一가-\ud7ff]+',
    '\\p{N}',
)
FALCON = (
    '[\\p{P}\\$\\+<=>\\^~\\|`]+',
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    '[0-9][0-9][0-9]',
)
STARCODER = (
    '\\p{N}',
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
)
GPT2 = (
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
)
QWEN2 = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n"
    ']*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+',
)
QWEN35 = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}"
    '\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+',
)
PORO = (
    ' ?[^(\\s|.,!?…。，、।۔،)]+',
)
VIKING = (
    ' ?[^(\\s|.,!?…。，、।۔،)]+',
    '\\p{N}',
)
TEKKEN = (
    '[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|[^\\'
    'r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|\\p{N}| '
    '?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+',
)
CHAMELEON = (
    '<sentinel:[0-9]+>',
    '(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z',
    '([\\t\\n]|    |  )',
    '\\p{N}',
    '[\\p{P}!-/:-@\\[-`{-~]',
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
)
GPT4O = (
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?i:'"
    "s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\"
    "p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|"
    '\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+',
)
GRANITE_EMB_MULTI = (
    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))*((?=[\\p{L}\\p{M}])([^A-Z]))+(?:'[sS]|'[tT]"
    "|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z])"
    ")+((?=[\\p{L}\\p{M}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{"
    'N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+',
)
TINY_AYA = (
    '\\d{1,3}(?=(?:\\d{3})*\\b)',
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?:'["
    "sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p"
    "{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL"
    "][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
)
BAILINGMOE = (
    "'(?i:[sdmt]|ll|ve|re)|[^\\r\\n\\p{L}\\p{N}]?+\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]++[\\r\\n]*|\\"
    's*[\\r\\n]|\\s+(?!\\S)|\\s+',
)
SEED_CODER = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\r\n]+|"
    '\\s*[\r\n]+|\\s+(?!\\S)|\\s+',
)
UFAKZEKA = (
    '[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|'
    '\\s+',
)
LAGUNA = (
    '[^\\n]+|[\\n]+',
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
    '| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+',
)
EXAONE_MOE = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*(?: \\p{L}\\p{M}*)*)+|\\p{N"
    '}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+',
)
MINICPM5 = (
    '\\p{N}{1,3}',
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}+| ?[^\\s\\p{L}\\p{N}]+[\\r\\"
    'n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+',
)

DEFAULT = (  # llama.cpp's `default:` case: no name in the file, or 'default'
    '[\\p{P}\\$\\+<=>\\^~\\|]+',
    GPT2[0],
    '\\p{N}+',
    '[0-9][0-9][0-9]',
)

REGEXES: Dict[str, Tuple[str, ...]] = {
    'DEFAULT': DEFAULT,
    'LLAMA3': LLAMA3,
    'JAIS2': JAIS2,
    'DBRX': LLAMA3,
    'SMAUG': LLAMA3,
    'DEEPSEEK_LLM': DEEPSEEK_LLM,
    'DEEPSEEK3_LLM': DEEPSEEK3_LLM,
    'HUNYUAN_DENSE': DEEPSEEK3_LLM,
    'JOYAI_LLM': DEEPSEEK3_LLM,
    'HY_V4': DEEPSEEK3_LLM,
    'SPARK2_5': SPARK2_5,
    'YOUTU': YOUTU,
    'DEEPSEEK_CODER': DEEPSEEK_CODER,
    'FALCON': FALCON,
    'STARCODER': STARCODER,
    'REFACT': STARCODER,
    'COMMAND_R': STARCODER,
    'SMOLLM': STARCODER,
    'CODESHELL': STARCODER,
    'EXAONE': STARCODER,
    'MINERVA': STARCODER,
    'MELLUM2': STARCODER,
    'GPT2': GPT2,
    'MPT': GPT2,
    'OLMO': GPT2,
    'JAIS': GPT2,
    'TRILLION': GPT2,
    'GRANITE_DOCLING': GPT2,
    'STABLELM2': QWEN2,
    'QWEN2': QWEN2,
    'HUNYUAN': QWEN2,
    'SOLAR_OPEN': QWEN2,
    'QWEN35': QWEN35,
    'PORO': PORO,
    'BLOOM': PORO,
    'GPT3_FINNISH': PORO,
    'CHATGLM4': LLAMA3,
    'VIKING': VIKING,
    'TEKKEN': TEKKEN,
    'CHAMELEON': CHAMELEON,
    'GPT4O': GPT4O,
    'MINIMAX_M2': GPT4O,
    'GRANITE_EMB_MULTI': GRANITE_EMB_MULTI,
    'TINY_AYA': TINY_AYA,
    'BAILINGMOE': BAILINGMOE,
    'SEED_CODER': SEED_CODER,
    'UFAKZEKA': UFAKZEKA,
    'GROK_2': QWEN2,
    'LAGUNA': LAGUNA,
    'EXAONE_MOE': EXAONE_MOE,
    'MINICPM5': MINICPM5,
}

# The names convert_hf_to_gguf.py writes (get_vocab_base_pre) -> the type llama.cpp gives them, and the settings
# llama.cpp changes with the type: ignore_merges (a word that is itself in the vocabulary is one token, as
# Hugging Face's `"ignore_merges": true`) and add_bos (the default when the file has no add_bos_token).
NAMES: Dict[str, str] = {
    "default": "DEFAULT", "minicpm5": "MINICPM5",
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano"), "LLAMA3"),
    "deepseek-llm": "DEEPSEEK_LLM", "deepseek-coder": "DEEPSEEK_CODER", "deepseek-v3": "DEEPSEEK3_LLM",
    "spark2_5": "SPARK2_5", "youtu": "YOUTU", "falcon": "FALCON", "mpt": "MPT", "starcoder": "STARCODER",
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
                     "mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4"), "GPT2"),
    "jais-2": "JAIS2", "refact": "REFACT", "command-r": "COMMAND_R",
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), "QWEN2"),
    "qwen35": "QWEN35", "stablelm2": "STABLELM2", "olmo": "OLMO", "dbrx": "DBRX", "smaug-bpe": "SMAUG",
    "poro-chat": "PORO", "chatglm-bpe": "CHATGLM4", "glm4": "CHATGLM4", "glm5": "CHATGLM4", "viking": "VIKING",
    "jais": "JAIS", "tekken": "TEKKEN", "smollm": "SMOLLM", "codeshell": "CODESHELL", "bloom": "BLOOM",
    "gpt3-finnish": "GPT3_FINNISH", "exaone": "EXAONE", "exaone-moe": "EXAONE_MOE", "chameleon": "CHAMELEON",
    "minerva-7b": "MINERVA", "gpt-4o": "GPT4O", "llama4": "GPT4O", "kanana2": "GPT4O", "talkie": "GPT4O",
    "granite-embed-multi-97m": "GRANITE_EMB_MULTI", "tiny_aya": "TINY_AYA", "cohere2moe": "TINY_AYA",
    "trillion": "TRILLION", "granite-docling": "GRANITE_DOCLING", "bailingmoe": "BAILINGMOE",
    "bailingmoe2": "BAILINGMOE", "llada-moe": "BAILINGMOE", "seed-coder": "SEED_CODER", "hunyuan": "HUNYUAN",
    "hunyuan-dense": "HUNYUAN_DENSE", "hy_v4": "HY_V4", "joyai-llm": "JOYAI_LLM", "ufakzeka": "UFAKZEKA",
    "grok-2": "GROK_2", "laguna": "LAGUNA", "minimax-m2": "MINIMAX_M2", "solar-open": "SOLAR_OPEN",
    "mellum2": "MELLUM2",
}
IGNORE_MERGES = {"LLAMA3", "MINICPM5", "YOUTU", "TEKKEN", "GRANITE_EMB_MULTI"}
IGNORE_MERGES_NAMES = {"glm4", "glm5"}  # the same type as chatglm-bpe, with ignore_merges
ADD_BOS = {"LLAMA3", "TEKKEN", "CHAMELEON"}
# Names llama.cpp knows whose split is hand-written code there (or not byte-level): refused, naming why.
UNSUPPORTED: Dict[str, str] = {
    "kimi-k2": "a hand-written split of Han characters", "afmoe": "a hand-written digit grouping",
    "superbpe": "an empty-width digit split", "gemma4": "raw UTF-8 pieces, not byte-level",
    "granite-embed-multi-311m": "raw UTF-8 pieces, not byte-level", "sarvam-moe": "raw UTF-8 pieces, not byte-level",
    "whitespace": "raw UTF-8 pieces, not byte-level",
}
DIGIT, GPT2_SPLIT = "\\p{N}", GPT2[0]


@dataclass(frozen=True)
class PreTokenizer:
    name: str  # the file's tokenizer.ggml.pre ('' when absent)
    regexes: Tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False

    def build(self):
        """The `tokenizers` pre-tokenizer: each regex isolated in turn, then the byte-level mapping. A single
        digit split is `Digits(individual_digits=True)` and a final GPT-2 regex is ByteLevel's own, the forms
        Hugging Face's GPT-2/SmolLM/StarCoder tokenizer.json files use."""
        steps = []
        for i, regex in enumerate(self.regexes):
            if regex == DIGIT:
                steps.append(pre_tokenizers.Digits(individual_digits=True))
            elif regex == GPT2_SPLIT and i == len(self.regexes) - 1:
                return pre_tokenizers.Sequence(steps + [pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=True)])
            else:
                steps.append(pre_tokenizers.Split(Regex(regex), behavior="isolated"))
        return pre_tokenizers.Sequence(steps + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def for_gguf(name, source: str) -> PreTokenizer:
    """The pre-tokenizer of a GGUF byte-level vocabulary whose tokenizer.ggml.pre is `name` (None: absent)."""
    if name is None or name == "":
        warnings.warn(f"{source}: no tokenizer.ggml.pre in the file; using llama.cpp's 'default' pre-tokenizer "
                      "(llama.cpp warns that generation quality will be degraded)", stacklevel=3)
        return PreTokenizer("", DEFAULT)
    if name in UNSUPPORTED:
        raise ValueError(f"{source}: tokenizer.ggml.pre {name!r} is not supported: llama.cpp splits it with "
                         f"{UNSUPPORTED[name]}; pass tokenizer_path (a tokenizer.json) instead")
    if name not in NAMES:
        raise ValueError(f"{source}: unknown tokenizer.ggml.pre {name!r}: not a pre-tokenizer llama.cpp knows "
                         f"(known: {', '.join(sorted(NAMES))}); pass tokenizer_path (a tokenizer.json) instead")
    kind = NAMES[name]
    return PreTokenizer(name, REGEXES[kind], kind in IGNORE_MERGES or name in IGNORE_MERGES_NAMES, kind in ADD_BOS)
