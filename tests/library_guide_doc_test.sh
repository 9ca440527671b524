#!/bin/bash
# docs/guide/library.md shows parts of examples/guide/library_guide.cpp: each part between two
# "// [NAME]" lines must appear in the guide as it is in the file (less its indentation).
root=${1:?usage: library_guide_doc_test.sh SOURCE_DIR}
/usr/bin/python3 - "$root" <<'PY'
import re, sys
root = sys.argv[1]
source = open(f"{root}/examples/guide/library_guide.cpp").read()
guide = open(f"{root}/docs/guide/library.md").read()
tags = sorted(set(re.findall(r"^ *// \[(\w+)\]$", source, re.M)))
failed = []
for tag in tags:
    m = re.search(r"^( *)// \[" + tag + r"\]\n(.*?)^ *// \[" + tag + r"\]\n", source, re.S | re.M)
    indent = len(m.group(1))
    part = "\n".join(l[indent:] if l.startswith(" " * indent) else l
                     for l in m.group(2).split("\n")).rstrip("\n")
    if part not in guide:
        failed.append(tag)
if failed or not tags:
    sys.exit(f"docs/guide/library.md differs from examples/guide/library_guide.cpp in: {failed}")
print(f"library.md shows {len(tags)} parts of library_guide.cpp as they are: {tags}")
PY
