#!/bin/sh
# Exit status 0 = the task is solved. Runs from the sandbox root.
exec python3 - <<'CHECK'
assert open('src/a.py').read() == 'bar = 1\nprint(bar)\n'
assert open('src/pkg/b.txt').read() == 'bar bar baz\n'
assert open('src/pkg/c.txt').read() == 'nothing here\n'
print('ok')
CHECK
