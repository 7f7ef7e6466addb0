"""The arithmetic example's reward: how much of the sum the response got right, digit by digit.

train.py calls reward(prompt, response, answer) once per response: prompt is the JSONL's text
("12+34="), response the decoded response without its stop token ("46"), answer the row's "answer".
"""


def reward(prompt: str, response: str, answer: str) -> float:
    """The fraction of the answer's digits right at their place, plus one share for the right length
    (stopping after the last digit): 1.0 for the exact sum, a dense signal on the way there."""
    right = sum(i < len(response) and response[i] == c for i, c in enumerate(answer))
    return (right + (len(response) == len(answer))) / (len(answer) + 1)
