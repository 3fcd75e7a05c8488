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
  with `tool_calls` (arguments as objects), `tool` turns with the results, and the answer after them.
  Eleven kinds of tool, each spelled several ways (names, parameters, descriptions), one to three offered a
  record; a third of the questions want none of the tools offered and are answered directly, so a tuned
  model learns the calling convention and when not to call, not two tool names.

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


def function(name, description, properties, required=None):
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(required or properties),
        "additionalProperties": False}}}


STRING = {"type": "string"}
# The sample's first record offers the classic pair, which the tests ask about.
TOOLS = [function("get_weather", "Current weather in a city.", {"city": STRING, "unit": {"enum": ["celsius",
                                                                                                   "fahrenheit"]}}),
         function("get_time", "The local time in a city.", {"city": STRING})]
PEOPLE = ["Maria", "Tom", "Aiko", "Lena", "Omar", "Priya", "Jonas", "Chen"]
WORDS = ["harbour", "lantern", "meadow", "quartz", "saffron", "tundra", "velvet", "orchid"]
TOPICS_NEWS = ["football", "science", "elections", "music", "the economy", "space"]
INGREDIENTS = ["chicken", "lentils", "tofu", "salmon", "mushrooms", "rice", "eggs"]
TICKERS = {"Apple": "AAPL", "Microsoft": "MSFT", "Tesla": "TSLA", "Nvidia": "NVDA", "Amazon": "AMZN"}
LANGUAGES = ["French", "Spanish", "German", "Japanese", "Italian"]


def tool_families(rng):
    """Each kind of tool the sample teaches, spelled one of several ways (name, parameter names, description):
    (its spec, a question that wants it, the call's arguments, the tool's result, the answer from it). What is
    taught is the convention, so no name or parameter recurs in every record."""
    country, city = rng.choice(list(CAPITALS.items()))
    other = rng.choice([c for c in CAPITALS.values() if c != city])
    person, word = rng.choice(PEOPLE), rng.choice(WORDS)
    place = rng.choice(["city", "location", "place"])
    unit = rng.choice(["celsius", "fahrenheit"])
    degrees = rng.randint(-5, 30) if unit == "celsius" else rng.randint(25, 90)
    hour, minute = rng.randint(0, 23), rng.choice([0, 15, 30, 45])
    company, ticker = rng.choice(list(TICKERS.items()))
    price = round(rng.uniform(20, 900), 2)
    language, ingredient, topic = rng.choice(LANGUAGES), rng.choice(INGREDIENTS), rng.choice(TOPICS_NEWS)
    value, (src, dst, factor) = rng.randint(2, 90), rng.choice([("km", "miles", 0.621), ("kg", "pounds", 2.205),
                                                                ("liters", "gallons", 0.264)])
    minutes = rng.choice([20, 30, 45])
    day = rng.choice(["Monday", "Friday", "tomorrow", "June 3"])
    people = rng.randint(2, 8)
    return [
        (function(rng.choice(["get_weather", "weather_now", "current_weather", "fetch_weather"]),
                  rng.choice(["Current weather in a city.", "Today's weather for a place."]),
                  {place: STRING, rng.choice(["unit", "units"]): {"enum": ["celsius", "fahrenheit"]}}),
         rng.choice(["What is the weather in {c}?", "Is it cold in {c} right now?", "How warm is it in {c}?",
                     "Do I need an umbrella in {c} today?"]).format(c=city) + rng.choice(["", f" In {unit}."]),
         None, f"{degrees} degrees, {rng.choice(['cloudy', 'sunny', 'raining'])}",
         f"It is {degrees} degrees {unit} in {city}."),
        (function(rng.choice(["get_time", "local_time", "current_time", "clock_in"]),
                  rng.choice(["The local time in a city.", "What the clock says somewhere now."]), {place: STRING}),
         rng.choice(["What time is it in {c}?", "Tell me the local time in {c}.", "Is it late in {c} now?"])
         .format(c=city), {place: city}, f"{hour:02d}:{minute:02d}", f"It is {hour:02d}:{minute:02d} in {city}."),
        (function(rng.choice(["get_stock_price", "stock_quote", "share_price"]),
                  rng.choice(["The latest price of a share.", "A stock's current quote."]),
                  {rng.choice(["symbol", "ticker"]): STRING}),
         rng.choice(["How much is {n} stock today?", "What is the share price of {n}?"]).format(n=company),
         ticker, f"{price} USD", f"{company} ({ticker}) trades at {price} USD."),
        (function(rng.choice(["translate", "translate_text"]), "Translates text into another language.",
                  {"text": STRING, rng.choice(["target_language", "language", "to"]): STRING}),
         f"Translate '{word}' into {language}.", (word, language), f"'{word}' in {language}: {word[::-1]}",
         f"In {language}, '{word}' is {word[::-1]}."),
        (function(rng.choice(["convert_units", "unit_converter"]), "Converts a quantity between units.",
                  {"value": {"type": "number"}, rng.choice(["from_unit", "from"]): STRING,
                   rng.choice(["to_unit", "to"]): STRING}),
         f"How many {dst} is {value} {src}?", (value, src, dst), f"{round(value * factor, 1)} {dst}",
         f"{value} {src} is {round(value * factor, 1)} {dst}."),
        (function(rng.choice(["find_recipes", "search_recipes", "recipe_search"]),
                  "Finds recipes by ingredient and time.",
                  {rng.choice(["ingredient", "main_ingredient"]): STRING,
                   rng.choice(["max_minutes", "time_limit"]): {"type": "integer"}}),
         f"Find me a {ingredient} recipe that takes under {minutes} minutes.", (ingredient, minutes),
         f"{ingredient.capitalize()} stir-fry, {minutes - 5} minutes",
         f"Try a {ingredient} stir-fry: it takes {minutes - 5} minutes."),
        (function(rng.choice(["search_flights", "find_flights", "flight_search"]), "Searches flights between cities.",
                  {rng.choice(["origin", "from_city"]): STRING, rng.choice(["destination", "to_city"]): STRING,
                   "date": STRING}),
         f"Find flights from {city} to {other} on {day}.", (city, other, day), "2 flights, from 210 EUR",
         f"There are 2 flights from {city} to {other} on {day}, from 210 EUR."),
        (function(rng.choice(["send_email", "email_send", "compose_email"]), "Sends an email.",
                  {rng.choice(["to", "recipient"]): STRING, "subject": STRING, "body": STRING}),
         f"Email {person} that the meeting moved to {day}.", (person, "Meeting", f"The meeting moved to {day}."),
         "sent", f"I emailed {person} that the meeting moved to {day}."),
        (function(rng.choice(["book_table", "reserve_table"]), "Books a table at a restaurant.",
                  {"restaurant": STRING, rng.choice(["people", "party_size", "guests"]): {"type": "integer"},
                   "time": STRING}),
         f"Book a table for {people} at Luna at {hour:02d}:00.", ("Luna", people, f"{hour:02d}:00"), "booked",
         f"Your table for {people} at Luna is booked for {hour:02d}:00."),
        (function(rng.choice(["get_news", "latest_headlines", "news_search"]), "Latest news headlines on a topic.",
                  {rng.choice(["topic", "query"]): STRING}),
         f"What is the latest news about {topic}?", (topic,), f"Headline: big week for {topic}",
         f"The top story: a big week for {topic}."),
        (function(rng.choice(["get_population", "population_of"]), "A country's population.",
                  {rng.choice(["country", "nation"]): STRING}),
         f"How many people live in {country}?", (country,), f"{rng.randint(3, 200)} million",
         None),
    ]


def call_arguments(spec, given):
    """The call's arguments: `given` in the order of the spec's parameters (a dict or values)."""
    names = list(spec["function"]["parameters"]["properties"])
    if isinstance(given, dict):
        return given
    values = given if isinstance(given, tuple) else (given,)
    return dict(zip(names, values))


NO_TOOL_ASKS = [("Say hello to {person}.", "Hello, {person}!"), ("What is {a} plus {b}?", "{a} plus {b} is {s}."),
                ("Spell the word {word}.", "{spelled}."), ("Write one sentence about {a_word}.",
                                                           "{A_word} can make an ordinary day feel special."),
                ("What is the capital of {country}?", "The capital of {country} is {city}."),
                ("Thank you!", "You're welcome."), ("Which country is {city} in?", "{city} is in {country}.")]


def make_tool_conversations(rng, n=144):
    """Tool use as TRL's tool-calling data sets hold it, taught as a convention rather than two names: each record
    offers one to three tools drawn from many kinds, each spelled one of several ways; about a third of the
    questions want none of the tools offered and are answered in text, so a tuned model learns when not to call.
    The first record is the classic weather-and-time pair."""
    out = []
    for i in range(n):
        families = tool_families(rng)
        if i == 0:
            country, city = "Norway", "Bergen"
            messages = [{"role": "user", "content": f"What is the weather in {city}?"},
                        {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                            "name": "get_weather", "arguments": {"city": city, "unit": "celsius"}}}]},
                        {"role": "tool", "name": "get_weather", "content": "9 degrees, raining"},
                        {"role": "assistant", "content": f"It is 9 degrees and raining in {city}."}]
            out.append({"tools": TOOLS, "messages": messages})
            continue
        offered = rng.sample(families, rng.randint(1, 3))
        tools = [spec for spec, *_ in offered]
        if i % 3 == 2:  # none of the tools helps
            country, city = rng.choice(list(CAPITALS.items()))
            a, b, word = rng.randint(2, 40), rng.randint(2, 40), rng.choice(WORDS)
            ask, answer = rng.choice(NO_TOOL_ASKS)
            fields = dict(person=rng.choice(PEOPLE), a=a, b=b, s=a + b, word=word, spelled="-".join(word.upper()),
                          a_word=a_or_an(word), A_word=a_or_an(word).capitalize(), country=country, city=city)
            messages = [{"role": "user", "content": ask.format(**fields)},
                        {"role": "assistant", "content": answer.format(**fields)}]
        else:
            spec, question, given, result, answer = rng.choice([f for f in offered if f[4] is not None] or offered)
            name = spec["function"]["name"]
            if given is None:  # the weather: the unit the question names, else celsius
                properties = list(spec["function"]["parameters"]["properties"])
                city = next(c for c in CAPITALS.values() if f" {c}" in question)
                given = {properties[0]: city, properties[1]: "fahrenheit" if "fahrenheit" in question else "celsius"}
                answer = answer.replace("celsius", given[properties[1]]).replace("fahrenheit", given[properties[1]])
            arguments = call_arguments(spec, given)
            messages = [{"role": "user", "content": question},
                        {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                            "name": name, "arguments": arguments}}]},
                        {"role": "tool", "name": name, "content": result},
                        {"role": "assistant", "content": answer or f"{result}."}]
        out.append({"tools": tools, "messages": messages})
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
