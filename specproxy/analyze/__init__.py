"""From stored turns to figures: summaries, intervals, verdicts, the whole-turn model, and the reports."""
