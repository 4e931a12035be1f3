"""Write ``core/quire/bench/data/corpus.txt``: the prose that benchmark prompts are cut from.

The text is generated here from word lists and sentence patterns written for Quire, so it
is ours to give away: it is dedicated to the public domain (CC0). It only has to be
varied English, so that prompts starting at different places share no prefix; it does
not have to make sense. The output depends only on ``SEED``: rerunning this script gives
the same file byte for byte, and the benchmark's workloads depend on that file.

Usage: ``python scripts/make_bench_corpus.py [--size BYTES]``
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

SEED = 20240613
TARGET = Path(__file__).resolve().parents[1] / "core/quire/bench/data/corpus.txt"

PEOPLE = [
    "the old miller", "a young surveyor", "the ferryman's daughter", "my grandmother",
    "the schoolmaster", "a travelling tinker", "the harbour pilot", "our neighbour Ruth",
    "the night watchman", "a weaver from the hills", "the parish clerk", "two shepherds",
    "the lighthouse keeper", "a clockmaker named Elias", "the widow Marsh", "the carters",
    "a boy with a lantern", "the apothecary", "Captain Hale", "the bookbinder's apprentice",
    "an elderly botanist", "the mapmaker", "Aunt Clara", "the blacksmith", "a quiet stranger",
    "the innkeeper", "the choir", "a pair of fishermen", "the stationmaster", "Doctor Penrose",
    "the orchard keeper", "a retired sailor", "the postmistress", "the glassblower",
    "young Tobias", "the beekeeper", "the surveyor's clerk", "a company of masons",
    "the potter", "Mistress Allard", "the ropemaker", "the river pilot", "an astronomer",
    "the cooper", "the lamplighter", "a family of tanners", "the chandler", "Father Ambrose",
]
PLACES = [
    "the northern ridge", "the salt marshes", "a mill on the Wenlow", "the market square",
    "the lower harbour", "an inn at Crossford", "the beech woods", "the old customs house",
    "the chalk downs", "a farm below Hartfell", "the cathedral close", "the tidal flats",
    "the quarry road", "a cottage at Ashby", "the upper meadows", "the ropewalk",
    "the copper mines", "the eastern gate", "a bridge over the Tamsin", "the fen villages",
    "the granary", "the weir at Millbrook", "the orchard terraces", "the moorland track",
    "the shipyard", "a chapel on the headland", "the drovers' road", "the town library",
    "the printing house", "the glass works", "the sheep fold", "the watermeadows",
    "the canal basin", "the observatory", "the hop gardens", "a lodge in the pines",
]
TIMES = [
    "in the spring of {year}", "one wet morning in {month}", "late in the autumn",
    "on the first dry day of {month}", "towards the end of {year}", "before dawn",
    "in the long evenings of {month}", "during the great frost of {year}", "at midsummer",
    "on market day", "after the harvest", "in the week of the fair", "at the turn of the tide",
    "while the bells rang for vespers", "in the hungry months", "on a clear night in {month}",
    "some {count} years later", "that same winter", "in the year {year}", "at first light",
]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]
ADJECTIVES = [
    "narrow", "crooked", "patient", "silver", "weathered", "careful", "bright", "hollow",
    "steady", "forgotten", "green", "sombre", "restless", "gentle", "tall", "broken",
    "ancient", "humble", "generous", "cold", "golden", "quiet", "stubborn", "ragged",
    "curious", "solemn", "brisk", "faded", "sturdy", "tender", "bitter", "lively",
]
THINGS = [
    "ledger", "lantern", "map of the coast", "bundle of letters", "wooden chest",
    "set of brass scales", "sack of barley", "ship's bell", "book of hours", "fishing net",
    "spinning wheel", "pair of oars", "basket of apples", "roll of linen", "compass",
    "iron key", "jar of honey", "bolt of wool", "weather vane", "carved bench",
    "loaf of rye bread", "telescope", "sheaf of sermons", "pewter jug", "hand cart",
    "quill and inkhorn", "coil of rope", "barometer", "printed almanac", "cask of cider",
]
ACTIONS = [
    "walked to", "rode out to", "was sent to", "came back from", "wrote a letter from",
    "spent the winter at", "opened a shop near", "lost a purse somewhere near",
    "kept a record of everything seen at", "drew a careful plan of", "sang at",
    "repaired the roof at", "carried the post to", "took shelter at", "was married at",
    "buried a small dog at", "counted the sheep at", "found work at", "held a meeting at",
    "argued for an hour at", "planted twelve pear trees at", "waited three days at",
]
OBSERVATIONS = [
    "the water stood higher than anyone could remember",
    "the swallows had come early and left late",
    "the price of salt had doubled since the previous year",
    "a fox had been seen crossing the ice",
    "the bells of {place} could be heard across the valley",
    "nobody would speak of the flood",
    "the roads were so deep in mud that carts went round by the fields",
    "the wheat stood thin and the barley stood thick",
    "the lamps were lit at four in the afternoon",
    "the children were taught their letters from a single slate",
    "every house kept a pig and most kept bees",
    "the wind turned the mill sails day and night",
    "strangers were welcome but rarely stayed",
    "the tide left a line of weed along the lower street",
    "the older people still counted in shillings and groats",
    "the well had been dug deeper after the dry summer",
    "the hedges were laid in the old way, with stakes of hazel",
    "a fair was held on the green every Michaelmas",
    "the river changed its bed after the storm of {year}",
    "there were {count} looms working in a single lane",
    "the road to {place} was closed for most of {month}",
    "the stars were clearer than in any city",
    "a {animal} nested every year under the {adjective} bridge",
    "a {animal} was kept in the yard of the inn for {count} weeks",
    "the {adjective} {thing} was shown to visitors on feast days",
    "{count} families shared one oven and one {thing}",
    "the snow lay until {month} and the {animal} came down to the gardens",
    "the rent was paid in eggs, wool and a {adjective} {thing}",
    "a {adjective} quarrel over a {thing} lasted until {year}",
    "the council met in {month} to argue about the {adjective} road",
    "the school had {count} pupils and one {adjective} master",
    "a {animal} was painted on the sign of every second house",
]
REFLECTIONS = [
    "It is easy to forget how slowly news travelled then.",
    "Nobody thought it remarkable at the time.",
    "The account books say little, but what they say is exact.",
    "Some of this was written down; most of it was only remembered.",
    "I have tried to set it down as plainly as I heard it.",
    "Whether it happened quite this way, no one can now say.",
    "There is a lesson in it, though not the obvious one.",
    "The details matter less than the habit of paying attention.",
    "Later writers made more of it than it deserved.",
    "It was the kind of thing that only looks important afterwards.",
    "Every family had a version of the story, and each was a little different.",
    "The weather, as always, decided more than the council did.",
]
CONNECTORS = ["Afterwards,", "Meanwhile,", "Even so,", "For a while", "In those days",
              "By then", "Not long after,", "Before long", "All the same,",
              "At about that time", "Some said that", "It was said that",
              "According to the parish book,"]
ANIMALS = ["heron", "fox", "barn owl", "otter", "pair of swans", "grey mare", "stray goat",
           "flock of starlings", "hare", "badger", "young bull", "kingfisher", "lame pony"]
CRAFT_VERBS = ["mended", "weighed", "sorted", "painted", "measured", "copied", "sharpened",
               "folded", "stitched", "polished", "labelled", "wrapped", "counted", "tuned"]
NOUNS_FOR_TITLES = ["Harbour", "Lantern", "Frost", "Orchard", "Ledger", "Ferry", "Mill",
                    "Road", "Bell", "Weir", "Compass", "Almanac", "Meadow", "Tide", "Quarry"]


class Prose:
    """Sentences and paragraphs from the lists above, drawn with one seeded generator."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def _fill(self, text: str) -> str:
        r = self.rng
        return text.format(year=r.randint(1610, 1899), month=r.choice(MONTHS),
                           count=r.randint(2, 60), place=r.choice(PLACES),
                           animal=r.choice(ANIMALS), adjective=r.choice(ADJECTIVES),
                           thing=r.choice(THINGS))

    def _pick(self, items: list[str]) -> str:
        return self._fill(self.rng.choice(items))

    def sentence(self) -> str:
        r = self.rng
        person, place, time = self._pick(PEOPLE), self._pick(PLACES), self._pick(TIMES)
        thing = f"{r.choice(ADJECTIVES)} {r.choice(THINGS)}"
        a_thing = f"{_article(thing)} {thing}"
        patterns = [
            f"{_cap(time)}, {person} {r.choice(ACTIONS)} {place}.",
            f"At {place}, {self._pick(OBSERVATIONS)}.",
            f"{_cap(person)} {r.choice(CRAFT_VERBS)} the {thing} and set it by "
            f"the door.",
            f"{r.choice(CONNECTORS)} {person} {r.choice(ACTIONS)} {place}, carrying "
            f"{a_thing}.",
            f"{self._pick(REFLECTIONS)}",
            f"{_cap(time)} it was noted that {self._pick(OBSERVATIONS)}.",
            f"There was {a_thing} at {place}, and {person} kept it for "
            f"{r.randint(2, 40)} years.",
            f"{_cap(person)} said that {self._pick(OBSERVATIONS)}, and that "
            f"{self._pick(OBSERVATIONS)}.",
            f"Nobody at {place} owned {a_thing} until {person} brought one {time}.",
            f"The {r.choice(ADJECTIVES)} road from {place} to {self._pick(PLACES)} took "
            f"{r.randint(2, 11)} hours on foot.",
        ]
        return r.choice(patterns)

    def paragraph(self) -> str:
        return " ".join(self.sentence() for _ in range(self.rng.randint(3, 8)))

    def chapter(self, number: int) -> str:
        title = f"{self.rng.choice(ADJECTIVES).capitalize()} {self.rng.choice(NOUNS_FOR_TITLES)}"
        paragraphs = [self.paragraph() for _ in range(self.rng.randint(4, 9))]
        return f"Chapter {number}. The {title}\n\n" + "\n\n".join(paragraphs) + "\n\n"


def _cap(text: str) -> str:
    """Upper-case the first letter only (``str.capitalize`` lowers the rest)."""
    return text[:1].upper() + text[1:]


def _article(noun_phrase: str) -> str:
    return "an" if noun_phrase[:1] in "aeiou" else "a"


def generate(size: int, seed: int = SEED) -> str:
    """At least ``size`` characters of prose, ending at a chapter's end."""
    prose = Prose(random.Random(seed))
    chapters: list[str] = []
    total = 0
    while total < size:
        chapters.append(prose.chapter(len(chapters) + 1))
        total += len(chapters[-1])
    return "".join(chapters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=160_000, help="characters, at least")
    args = parser.parse_args()
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    TARGET.write_text(generate(args.size), encoding="utf-8")
    print(f"wrote {TARGET} ({TARGET.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
