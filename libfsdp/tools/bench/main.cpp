// fsdp-bench: placeholder until the collectives benchmark lands.
int main() { return 0; }
