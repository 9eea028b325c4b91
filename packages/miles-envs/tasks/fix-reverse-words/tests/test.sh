#!/bin/sh
# Exit status 0 = the task is solved. Runs from the sandbox root.
exec python3 - <<'CHECK'
import sys
sys.path.insert(0, '.')
from words import reverse_words
assert reverse_words('a b c') == 'c b a'
assert reverse_words('  hello   world ') == 'world hello'
assert reverse_words('one') == 'one'
print('ok')
CHECK
