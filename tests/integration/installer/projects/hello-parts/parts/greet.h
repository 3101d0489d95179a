int hello_greet(void);
