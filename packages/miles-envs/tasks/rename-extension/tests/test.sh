#!/bin/sh
# Exit status 0 = the task is solved. Runs from the sandbox root.
exec python3 - <<'CHECK'
import os
names = sorted(os.listdir('notes'))
assert names == ['a.md', 'b.md', 'c.md', 'keep.csv'], names
assert open('notes/b.md').read() == 'bee\n'
print('ok')
CHECK
