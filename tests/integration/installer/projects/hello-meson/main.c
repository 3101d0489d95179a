#include <stdio.h>
int greet(void);
int main(void) { printf("greet %d\n", greet()); return 0; }
