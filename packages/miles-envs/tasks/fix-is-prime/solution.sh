#!/bin/sh
set -e
cat > mathutil.py <<'EOF'
def is_prime(n):
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True


def primes_below(n):
    return [k for k in range(n) if is_prime(k)]
EOF
