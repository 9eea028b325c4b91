#!/bin/sh
# Exit status 0 = the task is solved. Runs from the sandbox root.
exec python3 - <<'CHECK'
import sys
sys.path.insert(0, '.')
from mathutil import is_prime, primes_below
def ref(n):
    return n >= 2 and all(n % d for d in range(2, n))
assert [is_prime(n) for n in range(200)] == [ref(n) for n in range(200)]
assert primes_below(30) == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]
print('ok')
CHECK
