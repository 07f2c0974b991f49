"""Generate the embedded default corpus: English-like text with structure a small GPT can learn.

The recipe must train out of the box with no download, so it ships a small corpus made by
this script. The text is synthetic but not random: a tiny fixed "world" (countries and their
capitals, animals and their sounds, fruits and their colours) is stated consistently across
the corpus, stories keep a character's name and pronoun from the first sentence to the last,
dialogues alternate speakers, and arithmetic facts are true. A model that learns these
regularities shows it in the validation loss, which makes the corpus a useful smoke test
for parallel training (same loss curve, whatever the layout).

Deterministic: stdlib only, one seeded ``random.Random``, fixed-order word lists, and a gzip
header with ``mtime=0``, so the same seed always gives the same bytes::

    python -m recipes.gpt.make_corpus                      # rewrites recipes/gpt/data/corpus.txt.gz
    python -m recipes.gpt.make_corpus --out /tmp/c.txt.gz --num-bytes 200000 --seed 7
"""

from __future__ import annotations

import argparse
import gzip
import random
from collections.abc import Callable
from pathlib import Path

DEFAULT_OUT = Path(__file__).parent / "data" / "corpus.txt.gz"

# The fixed world: every document that mentions these facts states them the same way.
CAPITALS = {
    "Varnia": "Ostel", "Quell": "Marrow", "Tessaly": "Brindle", "Orvane": "Kell",
    "Lumeria": "Sable", "Dunhollow": "Pike", "Caravel": "Wend", "Ishmoor": "Tallow",
}  # fmt: skip
SOUNDS = {
    "dog": "woof", "cat": "meow", "cow": "moo", "duck": "quack", "sheep": "baa",
    "owl": "hoot", "horse": "neigh", "frog": "ribbit", "bee": "buzz", "lion": "roar",
}  # fmt: skip
FRUIT_COLOURS = {
    "apple": "red", "banana": "yellow", "lime": "green", "plum": "purple",
    "orange": "orange", "blueberry": "blue", "cherry": "red", "pear": "green",
}  # fmt: skip
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
           "eleven", "twelve"]  # fmt: skip
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]

SHE = ["Anna", "Mia", "Lily", "Zoe", "Nora", "Ella", "Ruby", "Iris", "Maya", "Clara", "Ada", "Tess"]
HE = ["Tom", "Leo", "Max", "Ben", "Sam", "Finn", "Otto", "Hugo", "Jack", "Noah", "Eli", "Oscar"]
PRONOUNS = {"she": ("she", "her", "her"), "he": ("he", "him", "his")}  # subject, object, possessive

ADJECTIVES = ["little", "brave", "curious", "sleepy", "happy", "clever", "shy", "kind", "tiny", "old"]
PLACES = ["village", "forest", "town", "farm", "garden", "valley", "harbour", "meadow"]
LANDMARKS = ["river", "hill", "lake", "bridge", "mill", "old tree", "lighthouse", "market"]
OBJECTS = ["ball", "kite", "key", "box", "hat", "lamp", "map", "book", "cup", "shell", "bell", "boat"]
COLOURS = ["red", "blue", "green", "yellow", "white", "black", "brown", "purple"]
ROOMS = ["kitchen", "garden", "attic", "bedroom", "shed", "hallway"]
ACTIVITIES = ["play by the water", "read under a tree", "sing songs", "look at the clouds",
              "pick flowers", "bake bread", "draw pictures", "run up the hill"]  # fmt: skip
FEELINGS = ["happy", "sad", "worried", "excited", "surprised", "tired"]
PROBLEMS = [
    ("it started to rain", "they waited under a roof until the sun came back"),
    ("the {obj} fell into the water", "{friend} helped to get it out with a long stick"),
    ("{subj} got lost on the way home", "{friend} showed {obj_p} the way back"),
    ("the wind took the {obj} away", "they ran after it and caught it by the {landmark}"),
    ("{subj} could not reach the {obj}", "{friend} brought a ladder"),
]  # fmt: skip


def _cap(text: str) -> str:
    """Capitalise the first letter only (``str.capitalize`` would lowercase proper names)."""
    return text[:1].upper() + text[1:]


def _a(word: str) -> str:
    """The indefinite article that reads right: "an apple", "a banana"."""
    return ("an " if word[0] in "aeiou" else "a ") + word


def _character(rng: random.Random) -> tuple[str, tuple[str, str, str]]:
    """A name with matching pronouns, so the model can learn agreement across sentences."""
    gender = rng.choice(["she", "he"])
    name = rng.choice(SHE if gender == "she" else HE)
    return name, PRONOUNS[gender]


def story(rng: random.Random) -> str:
    """A short story: one hero, one friend, one problem and its solution, a closing moral."""
    name, (subj, obj_p, poss) = _character(rng)
    friend, _ = _character(rng)
    while friend == name:
        friend, _ = _character(rng)
    animal = rng.choice(list(SOUNDS))
    obj, colour = rng.choice(OBJECTS), rng.choice(COLOURS)
    landmark, place = rng.choice(LANDMARKS), rng.choice(PLACES)
    problem, solution = rng.choice(PROBLEMS)
    fill = {"obj": f"{colour} {obj}", "landmark": landmark, "subj": name, "obj_p": obj_p, "friend": friend}
    lines = [
        f"Once upon a time, there was {_a(rng.choice(ADJECTIVES))} {animal} named {name}.",
        f"{name} lived in {_a(place)} near the {landmark}.",
        f"Every morning, {subj} liked to {rng.choice(ACTIVITIES)}.",
        f"One day, {name} found {_a(colour)} {obj}. {_cap(subj)} was very {rng.choice(FEELINGS)}.",
        f"{_cap(subj)} showed the {obj} to {poss} friend {friend}.",
        f"But then {problem.format(**fill)}.",
        f"In the end, {solution.format(**fill)}.",
        f"{name} said, \"Thank you, {friend}!\" and the {animal} said \"{SOUNDS[animal]}\".",
        rng.choice(["The end.", f"From that day on, {name} and {friend} were best friends.",
                    f"And {subj} kept the {obj} forever."]),
    ]  # fmt: skip
    return " ".join(lines)


def dialogue(rng: random.Random) -> str:
    """Two speakers taking turns; each answer is consistent with the question it follows."""
    a, _ = _character(rng)
    b, _ = _character(rng)
    while b == a:
        b, _ = _character(rng)
    turns: list[tuple[str, str]] = [(a, f"Hello, {b}!"), (b, f"Hello, {a}! How are you?")]
    turns.append((a, f"I am {rng.choice(FEELINGS)}, thank you."))
    a, b = b, a  # whoever asked "how are you" asks the first question
    for _ in range(rng.randint(2, 4)):
        kind = rng.randrange(4)
        if kind == 0:
            obj, room = rng.choice(OBJECTS), rng.choice(ROOMS)
            turns += [(a, f"Where is the {obj}?"), (b, f"The {obj} is in the {room}.")]
        elif kind == 1:
            country = rng.choice(list(CAPITALS))
            turns += [
                (a, f"What is the capital of {country}?"),
                (b, f"The capital of {country} is {CAPITALS[country]}."),
            ]
        elif kind == 2:
            fruit = rng.choice(list(FRUIT_COLOURS))
            turns += [
                (a, f"What colour is {_a(fruit)}?"),
                (b, f"{_cap(_a(fruit))} is {FRUIT_COLOURS[fruit]}."),
            ]
        else:
            x, y = rng.randint(0, 6), rng.randint(0, 6)
            turns += [
                (a, f"What is {NUMBERS[x]} plus {NUMBERS[y]}?"),
                (b, f"{_cap(NUMBERS[x])} plus {NUMBERS[y]} is {NUMBERS[x + y]}."),
            ]
        a, b = b, a  # the other speaker asks next
    turns.append((a, "Goodbye!"))
    lines: list[list[str]] = []  # [speaker, text]; one line per uninterrupted turn
    for who, text in turns:
        if lines and lines[-1][0] == who:
            lines[-1][1] += " " + text
        else:
            lines.append([who, text])
    return "\n".join(f"{who}: {text}" for who, text in lines)


def facts(rng: random.Random) -> str:
    """A paragraph of true statements about the fixed world, in varied order and phrasing."""
    sentences = []
    for _ in range(rng.randint(4, 8)):
        kind = rng.randrange(5)
        if kind == 0:
            country = rng.choice(list(CAPITALS))
            sentences.append(rng.choice([f"The capital of {country} is {CAPITALS[country]}.",
                                         f"{CAPITALS[country]} is the capital of {country}."]))  # fmt: skip
        elif kind == 1:
            animal = rng.choice(list(SOUNDS))
            sentences.append(f"{_cap(_a(animal))} says {SOUNDS[animal]}.")
        elif kind == 2:
            fruit = rng.choice(list(FRUIT_COLOURS))
            sentences.append(f"{_cap(_a(fruit))} is {FRUIT_COLOURS[fruit]}.")
        elif kind == 3:
            i = rng.randrange(len(DAYS))
            sentences.append(f"{DAYS[(i + 1) % 7]} comes after {DAYS[i]}.")
        else:
            i = rng.randrange(len(NUMBERS) - 1)
            sentences.append(f"{_cap(NUMBERS[i + 1])} comes after {NUMBERS[i]}.")
    return " ".join(sentences)


def arithmetic(rng: random.Random) -> str:
    """Counting runs and small sums in digits: exact patterns that reward in-context copying."""
    start = rng.randint(0, 5)
    count = ", ".join(NUMBERS[start : start + rng.randint(3, 7)])
    sums = []
    for _ in range(rng.randint(3, 6)):
        x, y = rng.randint(0, 9), rng.randint(0, 9)
        sums.append(f"{x} + {y} = {x + y}.")
    return f"Let us count: {count}. " + " ".join(sums)


GENERATORS: list[tuple[Callable[[random.Random], str], float]] = [
    (story, 0.4), (dialogue, 0.25), (facts, 0.2), (arithmetic, 0.15),
]  # fmt: skip


def make_corpus(num_bytes: int = 1_500_000, seed: int = 1337) -> str:
    """Concatenate documents, separated by a blank line, until about ``num_bytes`` of UTF-8."""
    rng = random.Random(seed)
    funcs, weights = zip(*GENERATORS, strict=True)
    docs: list[str] = []
    size = 0
    while size < num_bytes:
        (generate,) = rng.choices(funcs, weights=weights)
        doc = generate(rng)
        docs.append(doc)
        size += len(doc.encode("utf-8")) + 2
    return "\n\n".join(docs) + "\n"


def write_gzip(text: str, path: Path) -> None:
    """Write gzip with ``mtime=0`` so that regenerating gives byte-identical output."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with (
        open(path, "wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as f,
    ):
        f.write(text.encode("utf-8"))


def main(argv: list[str] | None = None) -> None:
    """Command line entry: ``python -m recipes.gpt.make_corpus [--out] [--num-bytes] [--seed]``."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="gzipped output file")
    parser.add_argument("--num-bytes", type=int, default=1_500_000, help="approximate uncompressed size")
    parser.add_argument("--seed", type=int, default=1337)
    args = parser.parse_args(argv)
    text = make_corpus(args.num_bytes, args.seed)
    write_gzip(text, args.out)
    print(
        f"wrote {len(text.encode('utf-8')):,} bytes of text to {args.out} ({args.out.stat().st_size:,} gzipped)"
    )


if __name__ == "__main__":
    main()
