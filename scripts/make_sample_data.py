"""Writes our own small data sets into tests/data (or DIR): deterministic, run it again and you get
the same files.

- dolly_sample.jsonl: Dolly-15k's schema. Dolly itself cannot be fetched offline, so tests and the demo
  train on this instead. It mixes the shapes Dolly has: empty and long contexts, unicode, multi-line
  answers, and a few records longer than 512 tokens.
- chat_sample.jsonl: multi-turn conversations in OpenAI's fine-tuning format ({"messages": [...]}), the
  shapes chat logs have: system and developer messages, text-part lists, follow-up questions that only
  make sense with the earlier turns, and assistant turns marked "weight": 0 (context, not taught). The
  assistant has one house style to learn: short answers that end with "Anything else?".
- tool_sample.jsonl: tool use in TRL's format: a `tools` column (OpenAI function specs), assistant turns
  with `tool_calls` (arguments as objects), `tool` turns with the results, and the answer after them;
  some questions need no tool and are answered directly, so a tuned model learns when to call.

    python3 scripts/make_sample_data.py [DIR]
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


STYLE = " Anything else?"  # the chat sample's house style, which a fine-tune should pick up
SYSTEM_PROMPTS = ["You are Atlas, a concise assistant.", "Answer in one short sentence.",
                  "You are a helpful assistant for a quiz night."]


def a_or_an(noun):
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def chat_pairs(rng):
    """One topic's (question, answer) turns; later questions lean on earlier ones ("And of Spain?")."""
    topic = rng.randrange(6)
    if topic == 0:
        countries = rng.sample(list(CAPITALS), 3)
        return [(f"What is the capital of {countries[0]}?", f"The capital of {countries[0]} is "
                 f"{CAPITALS[countries[0]]}.")] + [(f"And of {c}?", f"The capital of {c} is {CAPITALS[c]}.")
                                                  for c in countries[1:]]
    if topic == 1:
        animals = rng.sample(list(ANIMALS), 3)
        return [(f"What kind of animal is {a_or_an(animals[0])}?", f"{a_or_an(animals[0]).capitalize()} is "
                 f"{a_or_an(ANIMALS[animals[0]])}.")] + \
            [(f"And {a_or_an(a)}?", f"{a_or_an(a).capitalize()} is {a_or_an(ANIMALS[a])}.") for a in animals[1:]]
    if topic == 2:
        a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 9)
        return [(f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."),
                (f"And times {c}?", f"{a + b} times {c} is {(a + b) * c}.")]
    if topic == 3:
        colours = rng.sample(list(COLORS_FR), 3)
        return [(f"How do you say '{colours[0]}' in French?", f"In French, '{colours[0]}' is "
                 f"'{COLORS_FR[colours[0]]}'.")] + [(f"And '{c}'?", f"'{c}' is '{COLORS_FR[c]}'.") for c in colours[1:]]
    if topic == 4:
        words = rng.sample(FRUITS + VEGETABLES, 2)
        return [(f"Spell '{words[0]}' backwards.", f"'{words[0]}' backwards is '{words[0][::-1]}'."),
                (f"Now '{words[1]}'.", f"'{words[1]}' backwards is '{words[1][::-1]}'.")]
    hobby = rng.choice(HOBBIES)
    return [(f"I want to take up {hobby}. Where do I start?", f"Start small with {hobby} and set a weekly goal."),
            ("How often should I practise?", "Two or three short sessions a week is plenty.")]


def make_conversations(rng, n=240):
    """OpenAI fine-tuning records: 2-4 user turns, the house style on every taught answer."""
    out = []
    for i in range(n):
        pairs = chat_pairs(rng)[: rng.randint(2, 3)]
        if rng.random() < 0.3:
            pairs.append(("Thanks!", "You're welcome."))
        messages = []
        if rng.random() < 0.4:
            messages.append({"role": rng.choice(["system", "developer"]), "content": rng.choice(SYSTEM_PROMPTS)})
        untaught = rng.random() < 0.2  # an earlier answer kept as context only, in another style
        for k, (question, answer) in enumerate(pairs):
            content = [{"type": "text", "text": question}] if rng.random() < 0.15 else question
            messages.append({"role": "user", "content": content})
            if untaught and k == 0:
                messages.append({"role": "assistant", "content": answer.upper(), "weight": 0})
            else:
                messages.append({"role": "assistant", "content": answer + STYLE})
        out.append({"messages": messages})
    return out


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                          "parameters": {"type": "object", "properties": {
                                              "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                                              "required": ["city", "unit"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_time", "description": "The local time in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"], "additionalProperties": False}}}]
WEATHER_ASKS = ["What is the weather in {city}?", "Is it cold in {city} right now?", "How warm is it in {city}?",
                "Tell me the weather in {city}, please.", "Do I need an umbrella in {city} today?"]
TIME_ASKS = ["What time is it in {city}?", "Tell me the local time in {city}.", "Is it late in {city} now?"]
PLAIN_ASKS = [("What is the capital of {country}?", "The capital of {country} is {city}."),
              ("Which country is {city} in?", "{city} is in {country}.")]


def make_tool_conversations(rng, n=48):
    """Tool use as TRL's tool-calling data sets hold it; a third are questions answered without a tool."""
    out, places = [], list(CAPITALS.items())
    for i in range(n):
        country, city = rng.choice(places)
        kind = i % 3
        if kind == 2:
            ask, answer = rng.choice(PLAIN_ASKS)
            messages = [{"role": "user", "content": ask.format(city=city, country=country)},
                        {"role": "assistant", "content": answer.format(city=city, country=country)}]
        elif kind == 0:
            degrees, unit = rng.randint(-5, 30), rng.choice(["celsius", "fahrenheit"])
            shown = degrees if unit == "celsius" else round(degrees * 9 / 5 + 32)
            messages = [{"role": "user", "content": rng.choice(WEATHER_ASKS).format(city=city)},
                        {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                            "name": "get_weather", "arguments": {"city": city, "unit": unit}}}]},
                        {"role": "tool", "name": "get_weather", "content": f"{shown} degrees, cloudy"},
                        {"role": "assistant", "content": f"It is {shown} degrees and cloudy in {city}."}]
        else:
            hour, minute = rng.randint(0, 23), rng.choice([0, 15, 30, 45])
            messages = [{"role": "user", "content": rng.choice(TIME_ASKS).format(city=city)},
                        {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                            "name": "get_time", "arguments": {"city": city}}}]},
                        {"role": "tool", "name": "get_time", "content": f"{hour:02d}:{minute:02d}"},
                        {"role": "assistant", "content": f"It is {hour:02d}:{minute:02d} in {city}."}]
        out.append({"tools": TOOLS, "messages": messages})
    return out


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(records)} records to {path}")


def main():
    out = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent.parent / "tests/data")
    write_jsonl(out / "dolly_sample.jsonl", make_records(random.Random(15)))
    write_jsonl(out / "chat_sample.jsonl", make_conversations(random.Random(16)))
    write_jsonl(out / "tool_sample.jsonl", make_tool_conversations(random.Random(17)))


if __name__ == "__main__":
    main()
