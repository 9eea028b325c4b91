def is_prime(n):
    return all(n % i != 0 for i in range(2, int(n**0.5)))


def primes_below(n):
    return [k for k in range(n) if is_prime(k)]
