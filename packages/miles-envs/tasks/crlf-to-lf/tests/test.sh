#!/bin/sh
# Exit status 0 = the task is solved. Runs from the sandbox root.
exec python3 - <<'CHECK'
assert open('dos.txt', 'rb').read() == b'one\ntwo\nthree\n'
print('ok')
CHECK
