"""Commands as a committed record keeps them: the folders of the machine a run used are written as
the variables a reader sets ($WORK, $USER_DIR, $DATA_DIR), so that a record names no folder of that
machine and its commands read as a recipe's do."""

import os
import re


def portable(text, folders):
    """text with every folder of `folders` ({path: "$NAME"}) written as its variable, wherever the
    folder stands as a whole path or begins one, whether written as given or as an absolute path."""
    forms = {}
    for path, name in folders.items():
        path = str(path).rstrip("/") or "/"
        forms[path] = forms[os.path.abspath(path)] = name
    for path in sorted(forms, key=len, reverse=True):  # a folder inside another one first
        # not inside a longer path or word; followed by the end of the path
        pattern = rf"(?<![\w.~/$-]){re.escape(path)}(?=[/\s,:;'\")]|$)"
        text = re.sub(pattern, lambda _, name=forms[path]: name, text)
    return text
