"""Write the small agent datasets under data/agents/ (deterministic; no download).

The facts and passages describe an invented country, Veloria, so that a model cannot answer
from memory and has to call its tools:

* ``facts.json``: the General Agent's fact table (``lookup_fact``), name -> value;
* ``general_tasks.jsonl``: questions that need the calculator, unit conversion and/or a fact,
  with the gold ``answer`` (computed here from the facts);
* ``search_corpus.jsonl``: passages ``{"id", "title", "text"}`` for the Search Agent's BM25 index;
* ``search_questions.jsonl``: questions answered by a passage, with the gold ``answer``.

Prompts are plain strings, so the files mix with Hub datasets whose prompt column is a string
(``columns: {question: prompt}``); an agent recipe turns them into chats (``agent_system_prompt``).

Usage::

    python scripts/make_agent_data.py                 # writes data/agents/
    python scripts/make_agent_data.py --out /tmp/agents
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

FACTS = {
    "capital of Veloria": "Marrowgate",
    "currency of Veloria": "crown",
    "national animal of Veloria": "ash fox",
    "population of Marrowgate": "48200",
    "founding year of Marrowgate": "1781",
    "height of Mount Kessen in meters": "3912",
    "length of the river Ashwen in km": "412",
    "depth of Lake Orrin in meters": "214",
    "top speed of the Tallin express in km/h": "184",
    "opening year of the Tallin express": "1928",
    "weight of the Brenmoor bell in kg": "2750",
    "distance from Marrowgate to Pellis in miles": "87",
    "inventor of the Kessen lamp": "Ida Varn",
    "birth year of Ida Varn": "1853",
    "number of islands in the Sorrel archipelago": "37",
    "mass of a Velorian crown coin in grams": "8.5",
    "melting point of velorite in Celsius": "1460",
}


def _fact(key: str) -> float:
    return float(FACTS[key])


def general_tasks() -> list[tuple[str, str]]:
    """(question, gold answer) pairs; answers are computed from FACTS."""
    return [
        ("What is 347 * 29?", str(347 * 29)),
        ("What is (1250 - 387) / 4?", str((1250 - 387) / 4)),
        ("What is 2 ** 16 - 1000?", str(2**16 - 1000)),
        ("What is the square root of 7569?", str(math.isqrt(7569))),
        ("What is 0.17 * 2340?", str(round(0.17 * 2340, 6))),
        ("How many meters are in 3.5 miles? Round to the nearest meter.", str(round(3.5 * 1609.344))),
        ("What is 98.6 degrees Fahrenheit in Celsius?", str(round((98.6 - 32) * 5 / 9))),
        ("How many minutes are in 2.75 hours?", str(int(2.75 * 60))),
        ("How many pounds are 50 kg? Round to one decimal.", str(round(50 / 0.45359237, 1))),
        ("How many MiB are 3 GiB?", str(3 * 1024)),
        ("What is the capital of Veloria?", FACTS["capital of Veloria"]),
        ("Who invented the Kessen lamp?", FACTS["inventor of the Kessen lamp"]),
        ("What is the currency of Veloria?", FACTS["currency of Veloria"]),
        ("What is the national animal of Veloria?", FACTS["national animal of Veloria"]),
        ("How many people live in Marrowgate?", FACTS["population of Marrowgate"]),
        (
            "How tall is Mount Kessen in feet? Round to the nearest foot.",
            str(round(_fact("height of Mount Kessen in meters") / 0.3048)),
        ),
        (
            "How old was Ida Varn in the year the Tallin express opened?",
            str(int(_fact("opening year of the Tallin express") - _fact("birth year of Ida Varn"))),
        ),
        (
            "How many years after the founding of Marrowgate did the Tallin express open?",
            str(int(_fact("opening year of the Tallin express") - _fact("founding year of Marrowgate"))),
        ),
        (
            "What is the top speed of the Tallin express in mph? Round to the nearest whole number.",
            str(round(_fact("top speed of the Tallin express in km/h") * 1000 / 1609.344)),
        ),
        (
            "How far is Marrowgate from Pellis in kilometers? Round to the nearest kilometer.",
            str(round(_fact("distance from Marrowgate to Pellis in miles") * 1.609344)),
        ),
        (
            "How much does the Brenmoor bell weigh in pounds? Round to the nearest pound.",
            str(round(_fact("weight of the Brenmoor bell in kg") / 0.45359237)),
        ),
        (
            "How many kilograms do 1000 Velorian crown coins weigh?",
            str(round(_fact("mass of a Velorian crown coin in grams") * 1000 / 1000, 6)).removesuffix(".0"),
        ),
        (
            "What is the melting point of velorite in Fahrenheit?",
            str(round(_fact("melting point of velorite in Celsius") * 9 / 5 + 32)),
        ),
        (
            "If the people of Marrowgate were spread evenly over the islands of the Sorrel archipelago, how many "
            "whole people would each island get?",
            str(
                int(_fact("population of Marrowgate") // _fact("number of islands in the Sorrel archipelago"))
            ),
        ),
    ]


# (title, text) passages; the questions below are answered by them, the rest are distractors.
PASSAGES = [
    (
        "Veloria",
        "Veloria is a small country in the northern highlands. Its capital is Marrowgate and its "
        "currency is the crown. The ash fox is its national animal.",
    ),
    (
        "Marrowgate",
        "Marrowgate is the capital of Veloria. The river Ashwen flows through the old town, and the "
        "city was founded in 1781 by wool traders from the coast.",
    ),
    (
        "Pellis",
        "Pellis is a harbour town on the Sorrel coast, 87 miles from Marrowgate. Its lighthouse was "
        "designed by the engineer Tomas Brell.",
    ),
    (
        "River Ashwen",
        "The Ashwen rises on the slopes of Mount Kessen and runs 412 kilometres to Lake Orrin. "
        "Barges carried slate along it until 1902.",
    ),
    (
        "Mount Kessen",
        "Mount Kessen is the highest peak of Veloria at 3912 metres. The first recorded ascent was "
        "made in 1867 by the climber Hella Dorn.",
    ),
    (
        "Lake Orrin",
        "Lake Orrin is the deepest lake in Veloria, 214 metres at its deepest point. The village of "
        "Wenby stands on its eastern shore.",
    ),
    (
        "Tallin express",
        "The Tallin express is a passenger train between Marrowgate and Pellis. It opened in 1928 "
        "and reaches a top speed of 184 km/h.",
    ),
    (
        "Brenmoor bell",
        "The Brenmoor bell hangs in the tower of Brenmoor abbey. It weighs 2750 kilograms and was "
        "cast in 1702 by the foundry of Osric Hale.",
    ),
    (
        "Kessen lamp",
        "The Kessen lamp is a miner's safety lamp invented by Ida Varn in 1889. It burns velorite "
        "oil and gives a blue flame when firedamp is present.",
    ),
    (
        "Ida Varn",
        "Ida Varn was a Velorian chemist born in 1853 in Wenby. She is best known for the Kessen lamp "
        "and for isolating the mineral velorite.",
    ),
    (
        "Velorite",
        "Velorite is a grey mineral mined near Mount Kessen. It melts at 1460 degrees Celsius and is "
        "used to glaze the blue tiles of Marrowgate.",
    ),
    (
        "Sorrel archipelago",
        "The Sorrel archipelago lies off the coast near Pellis. Its 37 islands are home to "
        "seal colonies and to the ruined fort of Carrow.",
    ),
    (
        "Hella Dorn",
        "Hella Dorn was a mountaineer from Pellis. After climbing Mount Kessen she founded the "
        "Velorian Alpine Club in 1871.",
    ),
    (
        "Tomas Brell",
        "Tomas Brell was an engineer who built the lighthouse of Pellis in 1839 and the iron bridge "
        "over the Ashwen at Marrowgate in 1846.",
    ),
    (
        "Wenby",
        "Wenby is a fishing village on Lake Orrin. It is famous for smoked char and for its annual "
        "boat race, held every August since 1911.",
    ),
    (
        "Brenmoor abbey",
        "Brenmoor abbey was founded in 1214 by monks from the south. Its library holds the "
        "Brenmoor psalter, written in 1320.",
    ),
    (
        "Carrow fort",
        "The fort of Carrow on the Sorrel islands was built in 1590 to guard the straits and was "
        "abandoned in 1781.",
    ),
    (
        "Velorian crown",
        "The crown has been the currency of Veloria since 1904. A crown coin weighs 8.5 grams "
        "and shows the ash fox on its back.",
    ),
    (
        "Ash fox",
        "The ash fox is a grey fox of the Velorian highlands. It hunts voles in the snow and is the "
        "national animal of Veloria.",
    ),
    (
        "Osric Hale",
        "Osric Hale ran a bell foundry in Marrowgate. Besides the Brenmoor bell, he cast the bells "
        "of Saint Ilse church in 1709.",
    ),
    (
        "Velorian Alpine Club",
        "The Velorian Alpine Club was founded in 1871 by Hella Dorn. It keeps eleven huts "
        "on the slopes of Mount Kessen.",
    ),
    (
        "Marrowgate university",
        "Marrowgate university was founded in 1853 and is known for its school of "
        "mining. Its first rector was Aldo Pren.",
    ),
    (
        "Slate trade",
        "Slate from the Kessen quarries was shipped down the Ashwen to Lake Orrin until the railway "
        "took the trade in 1902.",
    ),
    (
        "Saint Ilse church",
        "Saint Ilse church in Marrowgate was rebuilt in 1708 after a fire. Its bells were "
        "cast by Osric Hale.",
    ),
]

SEARCH_QUESTIONS = [
    ("In which year was Marrowgate founded?", "1781"),
    ("Which river flows through Marrowgate?", "Ashwen"),
    ("Who made the first recorded ascent of Mount Kessen?", "Hella Dorn"),
    ("How deep is Lake Orrin in metres?", "214"),
    ("In which year did the Tallin express open?", "1928"),
    ("Who cast the Brenmoor bell?", "Osric Hale"),
    ("In which year was the Kessen lamp invented?", "1889"),
    ("In which village was Ida Varn born?", "Wenby"),
    ("At what temperature in Celsius does velorite melt?", "1460"),
    ("How many islands does the Sorrel archipelago have?", "37"),
    ("Who designed the lighthouse of Pellis?", "Tomas Brell"),
    ("When was the Velorian Alpine Club founded?", "1871"),
    ("Which fish is Wenby famous for smoking?", "char"),
    ("In which year was Brenmoor abbey founded?", "1214"),
    ("When was the fort of Carrow abandoned?", "1781"),
    ("Since which year has the crown been the currency of Veloria?", "1904"),
    ("What does the ash fox hunt in the snow?", "voles"),
    ("Who was the first rector of Marrowgate university?", "Aldo Pren"),
    ("In which year did the railway take over the slate trade?", "1902"),
    ("How many huts does the Velorian Alpine Club keep on Mount Kessen?", "eleven"),
    ("In which year was the iron bridge over the Ashwen at Marrowgate built?", "1846"),
    ("What colour is the flame of the Kessen lamp when firedamp is present?", "blue"),
    ("What is the top speed of the Tallin express in km/h?", "184"),
    ("How many kilograms does the Brenmoor bell weigh?", "2750"),
]


def write(out: Path) -> list[Path]:
    """Write the four files into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "facts.json": json.dumps(FACTS, indent=2) + "\n",
        "general_tasks.jsonl": "".join(
            json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in general_tasks()
        ),
        "search_corpus.jsonl": "".join(
            json.dumps({"id": f"p{i:03d}", "title": title, "text": text}) + "\n"
            for i, (title, text) in enumerate(PASSAGES)
        ),
        "search_questions.jsonl": "".join(
            json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in SEARCH_QUESTIONS
        ),
    }
    paths = []
    for name, text in files.items():
        path = out / name
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/agents", help="output folder (default: data/agents)")
    for path in write(Path(parser.parse_args().out)):
        print(path)


if __name__ == "__main__":
    main()
