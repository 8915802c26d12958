# labs/ holds generated student notebooks that raise NotImplementedError by design, and
# nbgrader's working folders hold copies: none of them is a test.
collect_ignore = ["labs", "submitted", "autograded", "feedback", ".venv"]
# The capstone's solution runs for minutes; the grading round trip (tests/test_labs.py) executes
# it in full and fails on any error, so nbval would only run it a second time.
collect_ignore.append("solutions/lab09_capstone")
