"""Chapters 10-14's graded exercises as a learner meets them: at least two per chapter, each with a skeleton cell
that checks a kernel holding `// your code here`, and below it a collapsed solution cell that exports
kernels/exercises/NN_name.cu and checks it. (Every solution passing, and its broken versions failing with a
message that names the problem, is tests/test_exercises.py's, over every chapter's exercises.)"""

import json
import re

import pytest

from gpt2_cupy import exercises
from gpt2_cupy.export import REPOSITORY

CHAPTERS = {"10": "10_adamw", "11": "11_autograd_tape", "11b": "11b_generated_kernels_and_fusion", "12": "12_gpt2",
            "13": "13_data_and_tokenizer", "14": "14_training"}
IDS = [exercise_id for exercise_id, chapter, _ in exercises.list() if chapter in CHAPTERS]


def _cells(chapter):
    notebook = json.loads((REPOSITORY / "chapters" / f"{CHAPTERS[chapter]}.ipynb").read_text(encoding="utf-8"))
    return [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]


def test_two_graded_exercises_per_chapter():
    for chapter in CHAPTERS:
        assert sum(exercises.exercise(i).chapter == chapter for i in IDS) >= 2, chapter


@pytest.mark.parametrize("exercise_id", IDS)
def test_the_chapter_has_the_skeleton_then_the_collapsed_solution(exercise_id):
    exercise = exercises.exercise(exercise_id)
    check = f'exercises.check("{exercise_id}", '
    cells = _cells(exercise.chapter)
    checking = [i for i, cell in enumerate(cells) if check in "".join(cell["source"])]
    assert len(checking) == 2, f"{exercise_id}: a skeleton cell and a solution cell check it"
    skeleton, solution = (cells[i] for i in checking)
    assert "// your code here" in "".join(skeleton["source"])
    assert not skeleton["metadata"].get("jupyter", {}).get("source_hidden")
    # the skeleton's stored verdict is a failure (the same line on every machine)
    verdict = "".join("".join(output.get("text", "")) for output in skeleton.get("outputs", []))
    assert re.match(rf"{re.escape(exercise_id)}: failed at ", verdict), verdict
    assert solution["metadata"]["jupyter"] == {"source_hidden": True, "outputs_hidden": True}
    assert "solution" in solution["metadata"]["tags"]
    assert "".join(solution["source"]).startswith(f"# export: kernels/exercises/{exercise.file_name}.cu\n")
