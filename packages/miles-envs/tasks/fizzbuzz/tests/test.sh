#!/bin/sh
# Exit status 0 = the task is solved. Runs from the sandbox root.
exec python3 - <<'CHECK'
import subprocess
lines = subprocess.run(['python3', 'fizzbuzz.py'], capture_output=True, text=True).stdout.split()
want = ['FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 else str(i) for i in range(1, 31)]
assert lines == want, lines
print('ok')
CHECK
