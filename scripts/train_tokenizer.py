#!/usr/bin/env python3
"""Train tokenpipe's default tokenizer ("tokenpipe-tiny") and write it to an assets directory.

The default model is a small, randomly initialised Llama-style decoder, so the tokenizer only has
to be realistic enough that prompts cost a plausible number of tokens and any text round-trips.
It is a byte-level BPE (GPT-2 style) with a 4096-entry vocabulary.

Reproducibility is the point of this script: the training corpus is generated here, offline,
from word lists kept in this file and a self-contained PRNG (splitmix64), so the corpus does not
depend on the Python version (``random``'s algorithms, stdlib docstrings) or on the network.
Running it twice gives a byte-identical ``tokenizer.json`` for a given ``tokenizers`` version;
``tests/e2e/test_tokenizer_training.py`` checks the shipped file against a fresh run.

Usage: ``python scripts/train_tokenizer.py [--out DIR]`` (default: ``pipeline/assets``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "pipeline" / "assets"

VOCAB_SIZE = 4096
SEED = 20240611
NUM_DOCUMENTS = 6000

# Order fixes the ids: <|endoftext|> is 0.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|image|>",
    "<|audio|>",
    "<|video|>",
]


# --------------------------------------------------------------------------------------------
# Word lists. Each list is ordered roughly by frequency: the sampler favours early entries, so
# the corpus has a Zipf-like shape and BPE learns whole tokens for the common words.
# --------------------------------------------------------------------------------------------

DETERMINERS = (
    "the the the a a an this that these those every each some many few several no another "
    "any most all both either neither our their its my your his her"
).split()

PRONOUNS = "it they we he she you I someone everyone nobody one this".split()

NOUNS = (
    "time year people way day man woman child world life hand part place case week company "
    "system program question work government number night point home water room mother area "
    "money story fact month lot right study book eye job word business issue side kind head "
    "house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door "
    "health person art war history party result change morning reason research girl guy moment "
    "air teacher force education foot boy age policy process music market sense nation plan "
    "college interest death experience effect use class control care field development role "
    "effort rate heart drug show leader light voice wife police mind price report decision son "
    "view relationship town road arm difference value building action model season society tax "
    "director position player record paper space ground form event official matter center "
    "couple site project activity star table need court oil situation cost industry figure "
    "street image phone data picture practice piece land product doctor wall patient worker news "
    "test movie north love support technology step baby computer type attention film tree source "
    "organization hair window evidence population site material network server request response "
    "client token model memory cache queue batch worker thread process message signal file "
    "directory function method value error warning record stream buffer packet socket channel "
    "library module package version release feature user account password key address host port "
    "device kernel driver engine pipeline scheduler tokenizer decoder encoder layer weight "
    "matrix vector tensor gradient parameter sample dataset benchmark metric latency throughput "
    "bridge river mountain forest garden ocean island village castle kitchen window bottle "
    "letter language science theory energy planet animal flower winter summer spring autumn "
    "journey answer problem solution example method surface pattern machine engineer student "
    "history museum teacher painter writer reader musician farmer captain soldier doctor nurse "
    "coffee bread cheese apple orange dinner breakfast lunch recipe market shop store price "
    "text sentence paragraph amount prompt instruction task reply summary translation"
).split()

ADJECTIVES = (
    "new good first last long great little own other old right big high different small large "
    "next early young important few public bad same able late hard major better economic strong "
    "possible whole free military true federal international full special easy clear recent "
    "certain personal open red difficult available likely short single medical current wrong "
    "private past foreign fine common poor natural significant similar hot dead central happy "
    "serious ready simple left physical general environmental financial blue democratic dark "
    "various entire close legal religious cold final main green nice huge popular traditional "
    "cultural quick quiet brown lazy bright careful gentle ancient modern tiny heavy light "
    "fast slow warm empty busy calm brave clever curious eager fair famous fresh friendly "
    "honest kind loud lucky narrow proud rare rich rough sharp smooth soft strange sweet "
    "thick thin wide wild wise young deterministic concurrent distributed asynchronous "
    "efficient reliable secure scalable robust correct invalid missing optional default"
).split()

VERBS = (
    "be have do say go get make know think take see come want look use find give tell work "
    "call try ask need feel become leave put mean keep let begin seem help talk turn start show "
    "hear play run move like live believe hold bring happen write provide sit stand lose pay "
    "meet include continue set learn change lead understand watch follow stop create speak read "
    "allow add spend grow open walk win offer remember love consider appear buy wait serve die "
    "send expect build stay fall cut reach kill remain suggest raise pass sell require report "
    "decide pull return explain hope develop carry break receive agree support hit produce eat "
    "cover catch draw choose cause point listen realize place close involve increase finish "
    "jump climb swim travel paint cook clean wash fix answer measure compute store load save "
    "parse encode decode schedule retry abort stream cache handle process compile deploy test "
    "train predict generate summarize translate describe"
).split()

IRREGULAR_PAST = {
    "be": "was",
    "have": "had",
    "do": "did",
    "say": "said",
    "go": "went",
    "get": "got",
    "make": "made",
    "know": "knew",
    "think": "thought",
    "take": "took",
    "see": "saw",
    "come": "came",
    "find": "found",
    "give": "gave",
    "tell": "told",
    "feel": "felt",
    "become": "became",
    "leave": "left",
    "put": "put",
    "mean": "meant",
    "keep": "kept",
    "let": "let",
    "begin": "began",
    "hear": "heard",
    "run": "ran",
    "hold": "held",
    "bring": "brought",
    "write": "wrote",
    "sit": "sat",
    "stand": "stood",
    "lose": "lost",
    "pay": "paid",
    "meet": "met",
    "lead": "led",
    "understand": "understood",
    "speak": "spoke",
    "read": "read",
    "spend": "spent",
    "grow": "grew",
    "win": "won",
    "buy": "bought",
    "send": "sent",
    "build": "built",
    "fall": "fell",
    "cut": "cut",
    "sell": "sold",
    "break": "broke",
    "eat": "ate",
    "catch": "caught",
    "draw": "drew",
    "choose": "chose",
    "swim": "swam",
    "die": "died",
}

ADVERBS = (
    "not also very often however too usually really early never always sometimes together "
    "likely simply generally instead actually again rather almost especially ever quickly "
    "probably already below directly therefore else thus easily eventually exactly certainly "
    "normally currently extremely finally constantly properly soon slowly carefully quietly "
    "suddenly nearly recently clearly only still just"
).split()

PREPOSITIONS = (
    "of in to for with on at from by about as into like through after over between out against "
    "during without before under around among across behind beyond near inside toward upon"
).split()

CONJUNCTIONS = "and and but or because while although when if so since until unless".split()

NAMES = (
    "Alice Bob Carol David Emma Frank Grace Henry Isabel James Karen Liam Maria Noah Olivia "
    "Peter Quinn Rachel Samuel Thomas Ursula Victor Wendy Xavier Yara Zoe London Paris Berlin "
    "Tokyo Madrid Rome Cairo Lisbon Oslo Vienna Monday Tuesday Wednesday Thursday Friday "
    "Saturday Sunday January February March April May June July August September October "
    "November December Python Linux GitHub English French German Spanish Chinese Japanese"
).split()

ACCENTED = [
    *"café naïve résumé façade jalapeño über déjà fiancée".split(),
    *"São Zürich Málaga Kraków".split(),
]

# A little non-Latin text so common multi-byte sequences get merges; anything else still
# round-trips through the 256 byte tokens.
FOREIGN_SNIPPETS = [
    "你好，世界。",
    "今日は良い天気です。",
    "안녕하세요",
    "Привет, мир!",
    "Γειά σου κόσμε",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "こんにちは",
    "谢谢你的帮助。",
    "🙂",
    "🚀",
    "👍",
    "🎉",
    "✅",
    "❤️",
    "→",
    "…",
    "—",
    "€",
    "°C",
    "½",
]

SYLLABLE_ONSETS = (
    "b c d f g h j k l m n p r s t v w z br ch cl cr dr fl gr pl pr sh st str th tr".split()
)
SYLLABLE_VOWELS = "a e i o u a e i o ai ea ee ie oo ou".split()
SYLLABLE_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ck", "ng", "rt", "sh"]

SUFFIXES = ["s", "ed", "ing", "er", "ly", "ness", "tion", "ment", "able", "ful", "less", "ity"]

CHAT_ROLES = ["system", "user", "assistant"]

RELATIVES = ["that", "which", "who", "where", "when"]

QUESTION_WORDS = ["What", "Where", "Why", "How", "When", "Which", "Who"]


class SplitMix64:
    """A tiny PRNG with a fixed algorithm, so the corpus does not depend on ``random``'s."""

    _MASK = (1 << 64) - 1

    def __init__(self, seed: int) -> None:
        self._state = seed & self._MASK

    def next_u64(self) -> int:
        self._state = (self._state + 0x9E3779B97F4A7C15) & self._MASK
        z = self._state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & self._MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & self._MASK
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        # Modulo bias is irrelevant here; determinism is what matters.
        return self.next_u64() % n

    def chance(self, numerator: int, denominator: int) -> bool:
        return self.below(denominator) < numerator

    def choice(self, seq: Sequence[str]) -> str:
        return seq[self.below(len(seq))]

    def skewed(self, seq: Sequence[str]) -> str:
        """Pick with a bias toward the front of ``seq`` (min of two uniform draws)."""
        return seq[min(self.below(len(seq)), self.below(len(seq)))]


def past_tense(verb: str) -> str:
    if verb in IRREGULAR_PAST:
        return IRREGULAR_PAST[verb]
    if verb.endswith("e"):
        return verb + "d"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ied"
    return verb + "ed"


def third_person(verb: str) -> str:
    special = {"be": "is", "have": "has", "do": "does", "go": "goes"}
    if verb in special:
        return special[verb]
    if verb.endswith(("s", "sh", "ch", "x", "z")):
        return verb + "es"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


def gerund(verb: str) -> str:
    if verb == "be":
        return "being"
    if verb.endswith("ie"):
        return verb[:-2] + "ying"
    if verb.endswith("e") and not verb.endswith("ee"):
        return verb[:-1] + "ing"
    return verb + "ing"


def plural(noun: str) -> str:
    irregular = {
        "man": "men",
        "woman": "women",
        "child": "children",
        "person": "people",
        "foot": "feet",
        "mouse": "mice",
        "life": "lives",
        "wife": "wives",
    }
    if noun in irregular:
        return irregular[noun]
    if noun.endswith(("s", "sh", "ch", "x", "z")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


def pseudo_word(rng: SplitMix64) -> str:
    """An invented, pronounceable word: keeps BPE learning subwords once real words are done."""
    syllables = 1 + rng.below(3)
    return "".join(
        rng.choice(SYLLABLE_ONSETS) + rng.choice(SYLLABLE_VOWELS) + rng.choice(SYLLABLE_CODAS)
        for _ in range(syllables)
    )


def noun_phrase(rng: SplitMix64) -> str:
    roll = rng.below(20)
    if roll == 0:
        return rng.choice(NAMES)
    if roll == 1:
        return rng.choice(PRONOUNS)
    determiner = rng.skewed(DETERMINERS)
    words = []
    if rng.chance(2, 5):
        words.append(rng.skewed(ADJECTIVES))
    if rng.chance(1, 12):
        words.append(rng.choice(ACCENTED))
    if rng.chance(1, 15):
        words.append(pseudo_word(rng) + rng.choice(SUFFIXES))
    noun = rng.skewed(NOUNS)
    words.append(plural(noun) if rng.chance(1, 3) else noun)
    if determiner in ("a", "an"):
        determiner = "an" if words[0][0] in "aeiou" else "a"
    return " ".join([determiner, *words])


def verb_phrase(rng: SplitMix64) -> str:
    verb = rng.skewed(VERBS)
    form = rng.below(6)
    if form == 0:
        head = past_tense(verb)
    elif form == 1:
        head = third_person(verb)
    elif form == 2:
        head = rng.choice(["is", "was", "are", "were", "will be", "has been"]) + " " + gerund(verb)
    elif form == 3:
        head = rng.choice(["will", "can", "should", "must", "might", "could"]) + " " + verb
    elif form == 4:
        head = rng.choice(["did not", "does not", "cannot", "would not"]) + " " + verb
    else:
        head = verb
    parts = [head]
    if rng.chance(1, 4):
        parts.append(rng.skewed(ADVERBS))
    if rng.chance(3, 5):
        parts.append(noun_phrase(rng))
    if rng.chance(1, 2):
        parts.append(rng.skewed(PREPOSITIONS) + " " + noun_phrase(rng))
    if rng.chance(1, 8):
        parts.append(
            rng.choice(RELATIVES) + " " + past_tense(rng.skewed(VERBS)) + " " + noun_phrase(rng)
        )
    return " ".join(parts)


def number(rng: SplitMix64) -> str:
    kind = rng.below(5)
    if kind == 0:
        return str(rng.below(10))
    if kind == 1:
        return str(rng.below(100))
    if kind == 2:
        return str(1900 + rng.below(130))
    if kind == 3:
        return f"{rng.below(1000)}.{rng.below(100):02d}"
    return f"{rng.below(100000):,}"


def sentence(rng: SplitMix64) -> str:
    if rng.chance(1, 8):
        subject = noun_phrase(rng)
        question = (
            f"{rng.choice(QUESTION_WORDS)} {rng.choice(['does', 'did', 'can', 'should', 'will'])} "
        )
        return question + subject + " " + rng.skewed(VERBS) + "?"
    if rng.chance(1, 10):
        clause = (
            rng.choice(["there are", "there were", "here are", "there is"]) + " " + noun_phrase(rng)
        )
        return clause[0].upper() + clause[1:] + "."
    clause = noun_phrase(rng) + " " + verb_phrase(rng)
    if rng.chance(1, 6):
        clause = rng.skewed(PREPOSITIONS) + " " + noun_phrase(rng) + ", " + clause
    if rng.chance(1, 4):
        clause += ", " + rng.skewed(CONJUNCTIONS) + " " + noun_phrase(rng) + " " + verb_phrase(rng)
    if rng.chance(1, 6):
        clause += f" in {number(rng)} " + plural(rng.skewed(NOUNS))
    if rng.chance(1, 10):
        clause += " (" + rng.choice(FOREIGN_SNIPPETS) + ")"
    text = clause[0].upper() + clause[1:]
    punct = rng.below(10)
    if punct < 7:
        return text + "."
    if punct < 9:
        return text + "?"
    return text + "!"


def identifier(rng: SplitMix64) -> str:
    parts = [rng.skewed(VERBS if i == 0 else NOUNS) for i in range(1 + rng.below(3))]
    return "_".join(parts)


def code_snippet(rng: SplitMix64) -> str:
    """Python and JSON fragments: prompts often contain code, and it exercises whitespace runs."""
    if rng.chance(1, 3):
        fields = ", ".join(
            f'"{rng.skewed(NOUNS)}": '
            + (f'"{rng.skewed(ADJECTIVES)}"' if rng.chance(1, 2) else number(rng))
            for _ in range(1 + rng.below(4))
        )
        return "{" + fields + "}\n"
    name = identifier(rng)
    args = ", ".join(rng.skewed(NOUNS) for _ in range(rng.below(4)))
    lines = [f"def {name}({args}):"]
    if rng.chance(1, 2):
        lines.append(f'    """{sentence(rng)}"""')
    for _ in range(1 + rng.below(3)):
        target = rng.skewed(NOUNS)
        if rng.chance(1, 2):
            lines.append(f"    {target} = {identifier(rng)}({rng.skewed(NOUNS)})")
        else:
            lines.append(f"    if {target} is None:")
            lines.append(f'        raise ValueError("{rng.skewed(ADJECTIVES)} {target}")')
    lines.append(f"    return {rng.skewed(NOUNS)}")
    return "\n".join(lines) + "\n"


def chat_transcript(rng: SplitMix64) -> str:
    """Plain-text role markers (no special tokens: those never enter BPE training)."""
    turns = []
    for i in range(2 + rng.below(3)):
        role = "system" if i == 0 and rng.chance(1, 3) else CHAT_ROLES[1 + i % 2]
        turns.append(f"{role}\n{sentence(rng)} {sentence(rng)}")
    return "\n".join(turns) + "\n"


def generate_corpus(seed: int = SEED, num_documents: int = NUM_DOCUMENTS) -> Iterator[str]:
    rng = SplitMix64(seed)
    for _ in range(num_documents):
        kind = rng.below(10)
        if kind < 7:
            paragraph = " ".join(sentence(rng) for _ in range(2 + rng.below(6)))
            yield paragraph + "\n\n"
        elif kind < 9:
            yield code_snippet(rng)
        else:
            yield chat_transcript(rng)


def train(vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(generate_corpus(), trainer=trainer)
    return tokenizer


def tokenizer_config() -> dict[str, object]:
    return {
        "eos_token": SPECIAL_TOKENS[0],
        "bos_token": None,
        "pad_token": SPECIAL_TOKENS[0],
        # The chat template is pipeline/assets/chat_template.jinja, beside these files.
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="output directory (default: %(default)s)"
    )
    args = parser.parse_args(argv)

    tokenizer = train()
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        actual = tokenizer.token_to_id(token)
        if actual != expected_id:
            raise SystemExit(f"special token {token!r} got id {actual}, expected {expected_id}")

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    print(f"wrote {out / 'tokenizer.json'} (vocab size {vocab_size})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
