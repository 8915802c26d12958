# labs/ holds generated student notebooks that raise NotImplementedError by design, and
# nbgrader's working folders hold copies: none of them is a test.
collect_ignore = ["labs", "submitted", "autograded", "feedback", ".venv"]
