"""Writes tests/data/dolly_sample.jsonl: a small Dolly-15k-schema data set of our own.

Dolly itself cannot be fetched offline, so tests and the demo train on this instead. It mixes the
shapes Dolly has: empty and long contexts, unicode, multi-line answers, and a few records longer
than 512 tokens. Deterministic: run it again and you get the same file.

    python3 scripts/make_sample_data.py [OUT.jsonl]
"""
import json
import random
import sys
from pathlib import Path

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "Canada": "Ottawa", "Australia": "Canberra", "Brazil": "Brasília", "Egypt": "Cairo",
    "Kenya": "Nairobi", "India": "New Delhi", "Mexico": "Mexico City", "Norway": "Oslo",
    "Peru": "Lima", "Poland": "Warsaw", "Portugal": "Lisbon", "Sweden": "Stockholm",
    "Türkiye": "Ankara", "Vietnam": "Hanoi", "Chile": "Santiago", "Greece": "Athens",
    "Ireland": "Dublin", "Austria": "Vienna", "Argentina": "Buenos Aires", "Thailand": "Bangkok",
}
ANIMALS = {
    "dolphin": "mammal", "salmon": "fish", "eagle": "bird", "frog": "amphibian", "python": "reptile",
    "bat": "mammal", "penguin": "bird", "shark": "fish", "salamander": "amphibian", "turtle": "reptile",
    "whale": "mammal", "owl": "bird", "trout": "fish", "gecko": "reptile", "newt": "amphibian",
}
FRUITS = ["apple", "banana", "cherry", "mango", "pear", "plum", "kiwi", "grape", "lemon", "peach"]
VEGETABLES = ["carrot", "leek", "onion", "potato", "spinach", "celery", "pepper", "radish"]
COLORS_FR = {"red": "rouge", "blue": "bleu", "green": "vert", "black": "noir", "white": "blanc",
             "yellow": "jaune"}
COLORS_JA = {"red": "赤 (aka)", "blue": "青 (ao)", "green": "緑 (midori)", "black": "黒 (kuro)",
             "white": "白 (shiro)"}
TOPICS = ["a rainy afternoon", "the first snow", "a lighthouse keeper", "a lost umbrella",
          "the night train", "a quiet library", "an old bicycle", "the harbour at dawn"]
HOBBIES = ["hiking", "painting", "chess", "gardening", "baking", "running", "photography"]

PARAGRAPH_BITS = [
    "The river rises in the northern hills and flows south for roughly 300 kilometres.",
    "Its valley has been farmed since the Bronze Age, and several mills still stand along its banks.",
    "In the nineteenth century a canal was cut to bypass the rapids near the old market town.",
    "Today the canal is used mostly by pleasure boats, while freight moves by rail.",
    "The town council restored the towpath in 2009, and it is now a popular cycling route.",
    "Flooding remains a problem in wet winters, when the meadows east of the bridge go under water.",
    "Local schools run an annual survey of the river's otters, kingfishers and dragonflies.",
    "A small museum near the lock tells the story of the boatmen and their families.",
]


def long_context(rng, sentences):
    return " ".join(rng.choice(PARAGRAPH_BITS) for _ in range(sentences))


def record(instruction, response, category, context=""):
    return {"instruction": instruction, "context": context, "response": response, "category": category}


def make_records(rng):
    out = []
    for country, capital in CAPITALS.items():
        out.append(record(f"What is the capital of {country}?", f"The capital of {country} is {capital}.",
                          "open_qa"))
    for animal, kind in ANIMALS.items():
        out.append(record(f"Is a {animal} a mammal, bird, fish, reptile or amphibian?",
                          f"A {animal} is a {kind}.", "classification"))
    for _ in range(40):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        out.append(record(f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.", "open_qa"))
    for _ in range(25):
        items = rng.sample(FRUITS + VEGETABLES, 5)
        fruits = [i for i in items if i in FRUITS]
        answer = ", ".join(fruits) if fruits else "None of them are fruits."
        out.append(record("Which of these are fruits? " + ", ".join(items), answer.capitalize()
                          if fruits else answer, "classification"))
    for english, french in COLORS_FR.items():
        out.append(record(f"How do you say '{english}' in French?", f"In French, '{english}' is '{french}'.",
                          "open_qa"))
    for english, japanese in COLORS_JA.items():
        out.append(record(f"How do you say '{english}' in Japanese?",
                          f"In Japanese, '{english}' is {japanese}.", "open_qa"))
    for hobby in HOBBIES:
        ideas = rng.sample(["start small", "find a local club", "keep a journal of progress",
                            "set a weekly goal", "watch how experts do it", "buy second-hand gear",
                            "invite a friend"], 4)
        answer = "\n".join(f"- {idea.capitalize()}." for idea in ideas)
        out.append(record(f"Give me four tips for getting started with {hobby}.", answer, "brainstorming"))
    for topic in TOPICS:
        lines = [f"I remember {topic},", "the light was soft and grey,",
                 "and nothing needed saying", "before it slipped away."]
        out.append(record(f"Write a short poem about {topic}.", "\n".join(lines), "creative_writing"))
    for _ in range(30):
        n = rng.randint(2, 7)
        ctx = long_context(rng, n)
        first = ctx.split(". ")[0].rstrip(".") + "."
        out.append(record("What is the first fact stated in this passage?", first, "closed_qa", ctx))
    for _ in range(20):
        ctx = long_context(rng, rng.randint(3, 6))
        out.append(record("Summarise this passage in one sentence.",
                          "The passage describes a river, its canal and how the valley uses them today.",
                          "summarization", ctx))
    for _ in range(15):
        name = rng.choice(["Ana", "Björn", "Chloé", "Dmitri", "Eun-ji", "Farah", "Gustavo"])
        age = rng.randint(18, 80)
        city = rng.choice(list(CAPITALS.values()))
        ctx = f"{name} is {age} years old and lives in {city}. {name} works as a teacher and enjoys chess."
        out.append(record(f"How old is {name} and where do they live?",
                          f"{name} is {age} years old and lives in {city}.", "information_extraction", ctx))
    for _ in range(20):
        word = rng.choice(FRUITS + VEGETABLES + list(ANIMALS))
        out.append(record(f"Spell the word '{word}' backwards.", f"'{word}' backwards is '{word[::-1]}'.",
                          "general_qa"))
    for _ in range(15):
        numbers = rng.sample(range(1, 100), 5)
        out.append(record("Sort these numbers from smallest to largest: " + ", ".join(map(str, numbers)),
                          ", ".join(map(str, sorted(numbers))) + ".", "general_qa"))
    # Records well over 512 tokens, so truncation paths are exercised.
    for _ in range(8):
        ctx = long_context(rng, 60)
        out.append(record("Summarise this long passage in one sentence.",
                          "A river valley, its restored canal and towpath, and the wildlife and history "
                          "that people there care about.", "summarization", ctx))
    for _ in range(4):
        steps = "\n".join(f"{i}. {rng.choice(PARAGRAPH_BITS)}" for i in range(1, 41))
        out.append(record("Describe the river in forty numbered points.", steps, "creative_writing"))
    out.append(record("Say hello in three languages.", "Hello!\nBonjour !\nこんにちは！", "open_qa"))
    out.append(record("What emoji is often used for a birthday?", "The birthday cake emoji: 🎂.", "open_qa"))
    out.append(record("What does the symbol π stand for?",
                      "π is the ratio of a circle's circumference to its diameter, about 3.14159.", "open_qa"))
    rng.shuffle(out)
    return out


def main():
    path = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent.parent / "tests/data/dolly_sample.jsonl")
    records = make_records(random.Random(15))
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(records)} records to {path}")


if __name__ == "__main__":
    main()
